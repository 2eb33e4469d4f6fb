"""CPU kernels: few-row products, packed drafting linears, the verify LM head, GQA routing and the allocator."""
