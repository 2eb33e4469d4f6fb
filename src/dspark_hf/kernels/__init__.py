"""CPU kernels: few-row products, packed drafting linears, the verify LM head and GQA routing."""
