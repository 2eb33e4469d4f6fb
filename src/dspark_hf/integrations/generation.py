"""`generate()` with a drafter: the `SpeculativeDecoder` as the decoding loop, on transformers' public hook.

Two ways in, both batched (left-padded prompts, each row token-identical to its own plain greedy decoding):

    target.generate(**inputs, custom_generate=dspark_hf.speculative_generate, drafter=drafter)  # no patching
    target.generate(**inputs, assistant_model=drafter)  # after import dspark_hf

`generate()` prepares the generation config, logits processors, stopping criteria and attention mask, then calls
`speculative_generate` in place of its own loop. That callable only receives keyword arguments its signature names
(`compat.py`), so `install()` (run once by `import dspark_hf`) wraps the public `GenerationMixin.generate`: a call
whose `assistant_model` is one of this package's drafters becomes the explicit form, with the streamer and
tokenizer passed on under names the hook keeps and stop strings turned into a stopping criterion; every other call
goes to transformers untouched. Pipelines call `model.generate(..., assistant_model=drafter)` and take this path.
A `custom_generate` beside a DSpark `assistant_model` must be this package's own (`generate`, `speculative_generate`,
or a DSpark Hub repo's `custom_generate/` folder, the Hub call of docs/usage.md): the call then runs the loop once;
any other `custom_generate` is refused, naming it.
`generate(model, ...)` is the same routing as a function, for the Hub `custom_generate/` folder.
"""

import copy
import functools
import sys

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.utils import logging

from ..decoding.core import SpeculativeDecoder
from ..decoding.drafting import is_drafter
from ..decoding.policy import VerifyPolicy
from ..decoding.rows import Row
from ..decoding.stats import DSparkGenerationStats
from ..kernels.weights import per_token_linears
from ..models.settings import check_sampling
from ..utils.compat import check_transformers_version


logger = logging.get_logger(__name__)

_MARKER = "_dspark_routing"
_ENTRY = "_dspark_generate"  # marks this module's entry points (`generate`, `speculative_generate`), flat copies too
_MODEL_KWARGS = {
    "attention_mask",
    "position_ids",
    "cache",
    "past_key_values",
    "use_cache",
    "logits_to_keep",
    "output_hidden_states",
    "output_attentions",
}  # the last two: read from the generation config


class _GenerateRow(Row):
    """A row of `generate()`'s batch: transformers' logits processors and stopping criteria, and its padding.

    `processor_ids()` is the row as `generate()` holds it (left padding included), so processors that count
    positions (min_new_tokens, ...) see what they see in plain decoding. Stopping: the length limit and EOS are
    checked on the token list; any other criterion (stop strings, user criteria) is asked token by token.
    """

    def __init__(self, padding, prompt, *, processors, others, eos, max_length, seed, keep, block_size, sampling):
        super().__init__(prompt, do_sample=seed is not None, seed=seed, block_size=block_size, sampling=sampling)
        self.padding, self.others, self.eos, self.max_length = padding, others, eos, max_length
        self.processors = processors
        self.limit: int | None = None  # set when the batch's length is known and this row must reach it
        self.stopped_at: int | None = None  # padded length where its stopping criteria first fired
        self.output: list[int] = []
        # per new token, as generate() returns them: processed (`output_scores`) and raw (`output_logits`) logits
        self.kept: dict[str, list[torch.Tensor]] = {name: [] for name in keep}
        self.keeps_hidden_states = "hidden_states" in keep  # (layers + 1, positions, d) per token

    @property
    def length(self) -> int:
        return len(self.padding) + len(self.seq)

    @property
    def remaining(self) -> int:
        end = self.max_length if self.limit is None else min(self.max_length, self.limit)
        return end - self.length

    def processor_ids(self) -> list[int]:
        return self.padding + self.seq

    def commit(self, tokens: list[int], scores=None, logits=None, hidden_states=None) -> int:
        taken = 0
        for j, token in enumerate(tokens[: self.remaining]):
            taken = j + 1
            length = self.length + taken
            stop = token in self.eos or length >= self.max_length
            if not stop and self.others is not None:
                ids = torch.tensor([self.processor_ids() + tokens[:taken]])
                stop = bool(self.others(ids, None if scores is None else scores[j : j + 1]).any())
            if stop and self.stopped_at is None:
                self.stopped_at = length
            if (stop and self.eos) or length >= self.max_length or (self.limit is not None and length >= self.limit):
                self.finished = True  # with EOS criteria a stopped row is padded; without, it decodes on
                break
        new = tokens[:taken]
        self.output += new
        self.stats.num_new_tokens = len(self.output)
        for name, values in (("scores", scores), ("logits", logits), ("hidden_states", hidden_states)):
            if name in self.kept and values is not None:
                self.kept[name] += [value.clone() for value in values[:taken]]
        return taken


class _Streaming:
    """What plain `generate()` hands a streamer: the prompt (B, L) first (the caller puts it), then one (B,) tensor
    per generated position, the pad id for rows that have finished. Rows commit different numbers of tokens per
    round, so a position goes out once every unfinished row has it. At batch 1 a round's new tokens go out together,
    as one (n,) tensor (streamers for batch 1 read any number of tokens per call)."""

    def __init__(self, streamer, rows: list[_GenerateRow], pad: int):
        self.streamer, self.rows, self.pad = streamer, rows, pad
        self.sent = 0  # positions handed out

    def release(self) -> None:
        """Put every position that no row can still change (call after a round, and once all rows are done)."""
        lengths = [len(row.output) for row in self.rows]
        ready = min((n for n, row in zip(lengths, self.rows) if not row.finished), default=max(lengths))
        if ready <= self.sent:
            return
        if len(self.rows) == 1:
            self.streamer.put(torch.tensor(self.rows[0].output[self.sent : ready]))
        else:
            for t in range(self.sent, ready):
                self.streamer.put(
                    torch.tensor([row.output[t] if t < n else self.pad for row, n in zip(self.rows, lengths)])
                )
        self.sent = ready


def _split_stopping(stopping_criteria) -> tuple[set[int], int | None, StoppingCriteriaList | None]:
    """(EOS ids, max length, the other criteria or None) of a prepared `StoppingCriteriaList`."""
    eos, max_length, others = set(), None, StoppingCriteriaList()
    for criterion in stopping_criteria or []:
        if isinstance(criterion, EosTokenCriteria):
            eos |= set(criterion.eos_token_id.flatten().tolist())
        elif isinstance(criterion, MaxLengthCriteria):
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        else:
            others.append(criterion)
    return eos, max_length, others if len(others) else None


def _check_call(model, generation_config, model_kwargs) -> None:
    """Refuse what the speculative loop cannot do, naming the option."""
    unsupported = {  # option: (refused?, why)
        "num_beams": (generation_config.num_beams != 1, "it decodes one sequence per row"),
        "num_return_sequences": (
            (generation_config.num_return_sequences or 1) != 1,
            "it decodes one sequence per row; repeat the prompt in the batch instead",
        ),
        "output_attentions": (
            bool(generation_config.output_attentions),
            "a verify attends over a cache with holes (rejected drafts), so its attention maps are not plain "
            "decoding's",
        ),
    }
    for name, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(
                f"Speculative decoding with a DSpark drafter does not support `{name}` "
                f"(got {getattr(generation_config, name)!r}): {why}. Drop it, or decode without the drafter."
            )
    if model.config.is_encoder_decoder:
        raise ValueError("Speculative decoding with a DSpark drafter needs a decoder-only target.")
    extra = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KWARGS and v is not None)
    if extra:
        raise ValueError(f"Speculative decoding with a DSpark drafter takes text input only; unsupported: {extra}.")
    for name in ("cache", "past_key_values"):  # transformers >= 5.25 renames `past_key_values` to `cache`
        cache = model_kwargs.get(name)
        cached = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        if cached > 0:  # the drafter needs the target's features of every position, which a cache does not hold
            raise ValueError(
                f"Speculative decoding with a DSpark drafter starts from the prompt; continuing a filled `cache` / "
                f"`past_key_values` ({cached} tokens) is not supported. Pass the whole conversation so far (earlier "
                "turns, their replies and the new turn) as `input_ids`, without the cache: the output is the same."
            )


# processors that need the whole batch in one call; rows here are processed one by one
_BATCH_PROCESSORS = {
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    # keeps per-call state (the contexts of earlier calls), which verifying several positions at once would corrupt
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config (SynthID)",
}


def _check_processors(processors) -> None:
    for processor in processors or []:
        option = _BATCH_PROCESSORS.get(type(processor).__name__)
        if option is not None:
            raise ValueError(
                f"Speculative decoding with a DSpark drafter processes each row's logits position by position, "
                f"which `{option}` does not allow; drop it, or decode without the drafter."
            )


def _row_processors(processors, index: int):
    """The logits processors as row `index` alone sees them, called with a batch of one (its own prefix).

    Processors built with one entry per batch row (`utils.compat.PRIVATE_API`) get a copy holding row `index`'s
    entry: the repetition penalty's padding length, the encoder-side penalties' prompt, a prefix constraint's batch
    index. Every other processor is shared as it is (they read only the ids they are called with).
    """
    if processors is None:
        return None
    out = LogitsProcessorList()
    for processor in processors:
        name = type(processor).__name__
        if name == "RepetitionPenaltyLogitsProcessor" and isinstance(processor.prompt_ignore_length, torch.Tensor):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[index : index + 1]
        elif name == "EncoderRepetitionPenaltyLogitsProcessor":
            processor = copy.copy(processor)
            processor.encoder_input_ids = processor.encoder_input_ids[index : index + 1]
        elif name == "EncoderNoRepeatNGramLogitsProcessor":
            processor = copy.copy(processor)
            processor.generated_ngrams, processor.batch_size = processor.generated_ngrams[index : index + 1], 1
        elif name == "PrefixConstrainedLogitsProcessor":
            allowed = processor._prefix_allowed_tokens_fn
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = functools.partial(_allowed_for_row, allowed, index)
        out.append(processor)
    return out


def _allowed_for_row(allowed, index: int, batch_id: int, sent):
    return allowed(index, sent)  # called on a batch of one: batch_id is 0, the row is `index` of the real batch


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[tuple[list[int], list[int]]]:
    """(padding, prompt) per row of a left-padded batch."""
    ids = input_ids.tolist()
    if attention_mask is None:
        return [([], row) for row in ids]
    mask = attention_mask.bool().tolist()
    out = []
    for row, keep in zip(ids, mask):
        pads = keep.index(True) if True in keep else len(keep)
        if not all(keep[pads:]) or pads == len(keep):
            raise ValueError(
                "Speculative decoding needs left-padded prompts (padding first, then every prompt token), each with "
                "at least one token; set `tokenizer.padding_side = 'left'`."
            )
        out.append((row[:pads], row[pads:]))
    return out


@torch.no_grad()
def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    drafter=None,
    token_streamer=None,
    target_tokenizer=None,
    verify_policy: str | None = None,
    sampling: str = "coupled",
    **model_kwargs,
):
    """The decoding loop of `generate()` with a drafter (pass it as `custom_generate=`, with `drafter=`).

    input_ids (B, L), left-padded per `attention_mask`. Each row is decoded speculatively on its own budget and
    stops where plain decoding stops it (EOS, length, stop strings, user criteria); the batch's output is
    `generate()`'s: (B, L + n) with finished rows padded, or a `GenerateDecoderOnlyOutput` with
    `return_dict_in_generate` (`scores` / `logits` per new token: the target's processed / raw logits;
    `hidden_states`: every layer's, of the forward that chose the token; rows that have finished get zeros;
    `output_attentions` is refused: verifies attend over a cache with holes, not plain decoding's).
    Sampling draws one seed per row from torch's global RNG (`torch.manual_seed` before the call reproduces it); a
    row's tokens then depend only on its seed and prompt, not on the policy, the batch or the machine's load.
    `sampling="standard"` decodes sampling rows with standard speculative (rejection) sampling instead of that
    coupling (`decoding/acceptance.py`): more drafts accepted per round, the same distribution, but the tokens a seed
    gives depend on the drafter and its settings; chains only (greedy rows ignore it).
    `token_streamer`: gets what plain decoding's streamer gets (`_Streaming`); `target_tokenizer` checks the pairing;
    `verify_policy` overrides the drafter's. The drafter's `generation_stats` holds the call's statistics.
    """
    if not is_drafter(drafter):
        raise TypeError(
            "speculative_generate needs `drafter=` one of this package's drafters (DSpark or EAGLE-3), got "
            f"{type(drafter).__name__}."
        )
    if input_ids.shape[-1] == 0:
        raise ValueError(
            f"generate() with a DSpark drafter needs a prompt of at least one token; `input_ids` has shape "
            f"{tuple(input_ids.shape)} (an empty string encodes to no tokens). Give some text, or start from BOS."
        )
    drafter.config.check_runtime_settings(drafter)  # settings changed on the live drafter, before any forward
    _check_call(model, generation_config, model_kwargs)
    check_sampling(sampling, getattr(drafter.config, "tree_budget", 0), generation_config.do_sample)
    drafter.config.check_target(model.config, target_tokenizer)
    eos, max_length, others = _split_stopping(stopping_criteria)
    max_length = generation_config.max_length if max_length is None else max_length
    processors = logits_processor if logits_processor is not None and len(logits_processor) else None
    _check_processors(processors)
    keep = [
        name
        for name in ("scores", "logits", "hidden_states")
        if generation_config.return_dict_in_generate and getattr(generation_config, f"output_{name}")
    ]
    if token_streamer is not None:
        token_streamer.put(input_ids.cpu())
    prompts = _prompts(input_ids, model_kwargs.get("attention_mask"))
    # sampling: one seed per row from torch's global RNG, so `torch.manual_seed(n)` before generate() reproduces
    seeds = [None] * len(prompts)
    if generation_config.do_sample:
        seeds = torch.randint(0, 2**63 - 1, (len(prompts),)).tolist()
    rows = [
        _GenerateRow(
            padding,
            prompt,
            processors=_row_processors(processors, index),
            others=others,
            eos=eos,
            max_length=max_length,
            seed=seed,
            keep=keep,
            block_size=drafter.config.block_size,
            sampling=sampling,
        )  # fmt: skip
        for index, ((padding, prompt), seed) in enumerate(zip(prompts, seeds))
    ]
    policy = VerifyPolicy.for_drafter(drafter, model, verify_policy, max_rows=len(rows))
    decoder = SpeculativeDecoder(model, drafter, policy=policy)
    streaming = None if token_streamer is None else _Streaming(token_streamer, rows, _pad_id(generation_config, eos))
    decoder.prefill(rows)
    while decoder.rows:
        if streaming is not None:
            streaming.release()
        decoder.step()
        decoder.retire()
        if not eos:  # plain decoding pads nothing without EOS: a stopped row decodes on until every row stopped
            _settle_length(rows, decoder)
    if streaming is not None:
        streaming.release()
        token_streamer.end()
    drafter.generation_stats = functools.reduce(
        DSparkGenerationStats.merge, [row.stats for row in rows[1:]], rows[0].stats
    )
    return _output(input_ids, rows, generation_config, eos)


def _settle_length(rows: list[_GenerateRow], decoder: SpeculativeDecoder) -> None:
    """Once every row has stopped, the batch's length is the latest stop: rows short of it decode on to it."""
    if any(row.stopped_at is None for row in rows) or rows[0].limit is not None:
        return
    limit = max(row.stopped_at for row in rows)
    for row in rows:
        row.limit = limit
        if row.length >= limit:
            row.finished = True
            cut = row.length - limit  # tokens it took past the batch's end
            if cut:
                del row.output[-cut:], row.seq[-cut:]
    decoder.retire()


def _pad_id(generation_config, eos: set[int]) -> int:
    """What finished rows are padded with, as plain decoding pads them: the pad id, else the first EOS id."""
    pad = generation_config.pad_token_id
    if pad is None:
        pad = generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, (list, tuple)) and pad else pad
        pad = (min(eos) if eos else 0) if pad is None or isinstance(pad, (list, tuple)) else pad
    return pad[0] if isinstance(pad, (list, tuple)) else pad


def _output(input_ids, rows: list[_GenerateRow], generation_config, eos: set[int]):
    """`generate()`'s return value: every row padded to the longest (`_pad_id`)."""
    pad = _pad_id(generation_config, eos)
    width = max(len(row.output) for row in rows)
    new = torch.tensor([row.output + [pad] * (width - len(row.output)) for row in rows], device=input_ids.device)
    sequences = torch.cat([input_ids, new.to(input_ids.dtype)], dim=1)
    if not generation_config.return_dict_in_generate:
        return sequences
    per_token = {}
    if "hidden_states" in rows[0].kept:
        per_token["hidden_states"] = _hidden_states_output(rows, input_ids.shape[1], width)
    for name in rows[0].kept.keys() - {"hidden_states"}:
        kept = [row.kept[name] for row in rows]
        if not any(kept):
            per_token[name] = ()
            continue
        zero = torch.zeros_like(next(v for values in kept for v in values))  # a finished row's step
        per_token[name] = tuple(
            torch.stack([values[t] if t < len(values) else zero for values in kept]) for t in range(width)
        )
    return GenerateDecoderOnlyOutput(sequences=sequences, **per_token)


def _hidden_states_output(rows: list[_GenerateRow], prompt_width: int, width: int) -> tuple:
    """As plain `generate()` returns them: per new token, per layer, (B, positions, d); the first token's are the
    prompt's (left-padded: padding positions hold zeros here), a finished row's later steps zeros."""
    per_row = [row.kept["hidden_states"] for row in rows]
    first = per_row[0][0]  # (layers + 1, L, d)
    steps = []
    for t in range(width):
        positions = prompt_width if t == 0 else 1
        stacked = first.new_zeros(len(rows), first.shape[0], positions, first.shape[-1])  # (B, layers + 1, P, d)
        for i, states in enumerate(per_row):
            if t < len(states):
                stacked[i, :, positions - states[t].shape[1] :] = states[t]
        steps.append(tuple(stacked.unbind(1)))
    return tuple(steps)


# -- routing generate(assistant_model=<drafter>) -----------------------------------------------------------------


def _routed_kwargs(model, kwargs: dict) -> dict:
    """`generate()` keyword arguments with `assistant_model=<drafter>` turned into the explicit custom_generate
    form."""
    kwargs = dict(kwargs)
    drafter = kwargs.pop("assistant_model")
    tokenizer = kwargs.pop("tokenizer", None)
    drafter.config.check_target(model.config, tokenizer)  # before transformers' own checks, with our message
    custom = kwargs.pop("custom_generate", None)
    if custom is not None:
        trust_remote_code = kwargs.pop("trust_remote_code", None)
        if not _is_dspark_generate(model, custom, trust_remote_code):
            name = custom if isinstance(custom, str) else getattr(custom, "__name__", type(custom).__name__)
            raise ValueError(
                f"`custom_generate={name!r}` is not DSpark's generate, and a DSpark `assistant_model` drafts only "
                "through DSpark's loop: drop `custom_generate` (or pass this package's / a DSpark Hub repo's), or "
                "decode without the drafter."
            )
    if kwargs.pop("assistant_tokenizer", None) is not None:
        raise ValueError(
            "A DSpark drafter shares the target's tokenizer; `assistant_tokenizer` (universal assisted decoding) "
            "does not apply. Drop it."
        )
    kwargs.update(custom_generate=speculative_generate, drafter=drafter, target_tokenizer=tokenizer)
    kwargs["token_streamer"] = kwargs.pop("streamer", None)
    config = kwargs.get("generation_config")
    stop_strings = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    if stop_strings:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the tokenizer: pass `tokenizer=` to generate().")
        if getattr(config, "stop_strings", None):
            config = kwargs["generation_config"] = config.__class__.from_dict(config.to_dict())
            config.stop_strings = None
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
    return kwargs


def _is_dspark_generate(model, custom, trust_remote_code) -> bool:
    """Whether `custom_generate=custom` is this package's generation: one of its entry points (in any copy, such as a
    Hub repo's `custom_generate/` folder) or a repo whose `custom_generate/generate.py` is one. A repo id or folder
    is loaded as `generate()` would load it (transformers' `load_custom_generate`, which needs `trust_remote_code`)."""
    if isinstance(custom, str):
        custom = model.load_custom_generate(custom, trust_remote_code=trust_remote_code)
    if getattr(custom, _ENTRY, False):
        return True
    # a `custom_generate/` folder written before the marker: the flat copy of this module's `generate`
    module = sys.modules.get(getattr(custom, "__module__", None) or "")
    return getattr(custom, "__name__", None) == "generate" and all(
        callable(getattr(module, name, None)) for name in ("speculative_generate", "_routed_kwargs")
    )


def _batch_size(args: tuple, kwargs: dict) -> int:
    """Rows in a `generate()` call's prompt tensor (1 where there is none: generation from BOS)."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    return ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1


def _plain_reason(model, args: tuple, kwargs: dict) -> str | None:
    """Why a call with a drafter decodes plain instead (None: it decodes speculatively).

    A PyTorch dynamically quantized target quantizes each call's activations with one scale for the whole call, so in
    a batch every row's logits depend on its batch mates. The rows a speculative round verifies can only match plain
    decoding token by token (`kernels/weights.per_token_activations`), which costs a batch of B rows B calls per
    linear in every round, plain rounds included: about half plain batched decoding's speed (issue 51's matrix). So
    such a batch decodes through transformers' own loop, exactly as without the drafter."""
    rows = _batch_size(args, kwargs)
    if rows > 1 and per_token_linears(model):
        return (
            f"{type(model).__name__} has dynamically quantized linears, whose activation scale spans the whole batch; "
            f"drafting for {rows} rows at once could keep each row identical to plain decoding only by verifying "
            "token by token, which is slower than plain, so this call decodes plain (no drafts). Batch 1 drafts."
        )
    return None


def _routed(model, original, args: tuple, kwargs: dict):
    """A `generate()` call with `assistant_model=<a drafter of this package>`: speculative through the public hook,
    or plain where drafting cannot pay (`_plain_reason`; the drafter's `generation_stats` then says so)."""
    routed = _routed_kwargs(model, kwargs)  # checks the pairing and the arguments either way
    reason = _plain_reason(model, args, kwargs)
    if reason is None:
        return original(model, *args, **routed)
    logger.info(reason)
    drafter = kwargs["assistant_model"]
    plain = {k: v for k, v in kwargs.items() if k not in ("assistant_model", "custom_generate", "trust_remote_code")}
    out = original(model, *args, **plain)
    drafter.generation_stats = _plain_stats(model, drafter, args, kwargs, out)
    return out


def _plain_stats(model, drafter, args: tuple, kwargs: dict, out) -> DSparkGenerationStats:
    """The statistics of a call decoded plain: every step a target forward with no draft, counted as gated."""
    sequences = out.sequences if hasattr(out, "sequences") else out
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    width = ids.shape[-1] if isinstance(ids, torch.Tensor) else 0
    mask = kwargs.get("attention_mask")
    configs = (kwargs.get("generation_config"), model.generation_config)

    def setting(name):  # as generate() reads it: a keyword argument, else the call's config, else the model's
        found = [kwargs.get(name)] + [getattr(c, name, None) for c in configs]
        return next((value for value in found if value is not None), None)

    eos, pad = setting("eos_token_id"), setting("pad_token_id")
    eos = set([eos] if isinstance(eos, int) else eos or [])
    stats = DSparkGenerationStats(drafter.config.block_size)
    stats.num_prompt_tokens = int(mask.sum()) if isinstance(mask, torch.Tensor) else width * len(sequences)
    for row in sequences[:, width:].tolist():
        ends = [i for i, token in enumerate(row) if token in eos]
        new = ends[0] + 1 if ends else len(row)
        # a row stopped early by a stop string or a criterion is padded while the batch goes on
        while not ends and pad is not None and new and row[new - 1] == pad:
            new -= 1
        stats.num_new_tokens += new
        for _ in range(new - 1):  # the first token is the prefill's
            stats.record_step(0, 0)
        stats.gated_rounds += max(0, new - 1)
    return stats


def generate(model, *args, **kwargs):
    """`model.generate(*args, **kwargs)` with `assistant_model=<a drafter of this package>` run speculatively through
    the public hook; any other call is transformers' own. Also the Hub `custom_generate/generate.py` entry point."""
    if is_drafter(kwargs.get("assistant_model")):
        return _routed(model, _original_generate, args, kwargs)
    return _original_generate(model, *args, **kwargs)


setattr(generate, _ENTRY, True)
setattr(speculative_generate, _ENTRY, True)


def _original_generate(model, *args, **kwargs):
    method = GenerationMixin.generate
    return getattr(method, "_dspark_original", method)(model, *args, **kwargs)


def install() -> None:
    """Route `generate(assistant_model=<drafter of this package>)` through `speculative_generate` for every model, by
    wrapping the public `GenerationMixin.generate` once. Idempotent; other calls are untouched."""
    check_transformers_version()
    current = GenerationMixin.generate
    if getattr(current, _MARKER, False):
        return

    @functools.wraps(current)
    def routed(self, *args, **kwargs):
        if is_drafter(kwargs.get("assistant_model")):
            return _routed(self, current, args, kwargs)
        return current(self, *args, **kwargs)

    setattr(routed, _MARKER, True)
    routed._dspark_original = current
    GenerationMixin.generate = routed


def uninstall() -> None:
    """Undo `install()`."""
    current = GenerationMixin.generate
    if getattr(current, _MARKER, False):
        GenerationMixin.generate = current._dspark_original


__all__ = ["generate", "install", "is_drafter", "speculative_generate", "uninstall"]
