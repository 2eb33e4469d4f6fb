"""`DSparkCandidateGenerator`: the adapter between transformers' assisted-decoding loop and a DSpark drafter.

`DrafterCandidateGenerator` is what every drafter of this package shares with it (target taps, the drafter's
context bookkeeping, stop strings, statistics); a subclass implements `draft` (EAGLE-3: `Eagle3CandidateGenerator`).

Each round of `generate()` (batch size 1):
  gate     under verify_policy "scheduler" (and `config.draft_gate`): skip the draft when it is not expected to pay
           (`scheduler.DraftGate`); the round is then a plain step and its features wait for the next draft;
  draft    append the target features of the tokens committed since the last draft to the drafter's context
           cache, run one parallel block pass, crop the block's own K/V again;
  schedule sample the block token by token through the sequential head, stopping where the admission policy
           (confidence threshold or Algorithm 1) says verification no longer pays;
  verify / accept / commit / crop: done by transformers' loop, against the processed biased draft logits we return,
           so greedy output is token-identical and sampling is exact rejection sampling. Between a draft and its
           verify the target's CPU float32 linears compute their few rows the fast way (`verify_head`); the
           drafter's CPU linears always do, through packed weights (`packed_linear`).
"""

import time
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from .generation import eos_token_ids
from .packed_linear import pack_linears
from .profiling import sps_for
from .scheduler import DraftGate, build_admission, conditional_confidences
from .stats import DSparkGenerationStats
from .verify_head import attach, set_verifying


if TYPE_CHECKING:  # custom_generate/ ships this module without the modeling code
    from .modeling_dspark import DSparkBlockDraft


class DrafterCandidateGenerator(CandidateGenerator):
    """Drafts from the target's own hidden states with one of this package's drafters; subclasses implement `draft`.

    Args:
        drafter: a `DrafterMixin` model (or its remote-code twin) whose config is a `DrafterConfig`.
        target: the model running `generate()`; its embedding and LM head are borrowed by the drafter.
        generation_config: the call's `GenerationConfig` (`do_sample`, `max_length`, EOS ids).
        logits_processor: the call's processors and warpers; draft logits go through the same ones.
    """

    requires_model_outputs = True

    def __init__(self, drafter, target, generation_config, logits_processor=None, input_ids=None, tokenizer=None):
        config = drafter.config
        config.check_target(target.config, tokenizer)
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"{type(drafter).__name__} in generate() drafts for one sequence at a time, got a batch of "
                f"{input_ids.shape[0]}. Call generate() per prompt (pipelines do this with batch_size=1)."
            )
        self.drafter, self.config = drafter, config
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(target).__name__} has no output embeddings (LM head) for the drafter to borrow.")
        self.target = target
        attach(target)  # CPU float32 linears verify a few rows faster (verify_head.py)
        pack_linears(drafter)  # CPU linears of the drafter through oneDNN's packed weights (packed_linear.py)
        set_verifying(target, False)  # on only between a draft and its verify (a failed call may have left it on)
        self.logits_processor = logits_processor if logits_processor is not None and len(logits_processor) else None
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos_ids = eos_token_ids(generation_config)
        self.stop_strings = None
        if generation_config.stop_strings:
            if tokenizer is None:
                raise ValueError("`stop_strings` needs the tokenizer: pass `tokenizer=` to generate().")
            self.stop_strings = StopStringCriteria(tokenizer=tokenizer, stop_strings=generation_config.stop_strings)
        # Ask the target for exactly the tapped layers (+1: entry 0 of `hidden_states` is the embedding output).
        # With a user request for all hidden states, a list would crash `_split_model_outputs`, so keep `True`.
        taps = [i + 1 for i in config.target_layer_ids]
        self.model_kwargs_overrides = {
            "output_hidden_states": True if generation_config.output_hidden_states else taps
        }
        self.cache = DynamicCache()  # the drafter's cache of context entries
        self.context_len = 0  # target positions whose features the drafter has consumed
        self.waiting: list[torch.Tensor] = []  # features of gated rounds, for the next draft pass
        self.gate: DraftGate | None = None  # set by a subclass that can price its drafts
        self.hint: list[float] | None = None  # the last draft's conditional confidences, for the gate
        self.pending = None  # (sequence length, drafts proposed, survivals examined); None for the prefill
        self.stats = DSparkGenerationStats(block_size=config.block_size)
        drafter.generation_stats = self.stats

    @property
    def num_drafting_tokens(self) -> int:
        """Read by the transformers 5.25 loop; the most drafts a round can propose."""
        return self.config.block_size

    def _new_context(self, input_ids, model_outputs, n_last_matches: int) -> torch.Tensor:
        """Target features of the positions committed since the last round: (1, n_new, m·d).

        After the prefill these are all prompt positions; later the old anchor plus the accepted drafts, i.e. the
        first `n_last_matches + 1` positions of the verify pass. The newest token (the bonus) becomes the anchor and
        has no features yet: context ends at position `len(input_ids) - 2`.
        """
        n_new = input_ids.shape[1] - 1 - self.context_len - sum(c.shape[1] for c in self.waiting)
        if self.context_len and n_new != n_last_matches + 1:
            raise RuntimeError(f"Drafter context out of sync: {n_new} new positions, {n_last_matches} accepted.")
        states = model_outputs.hidden_states
        return torch.cat([states[i + 1][:, :n_new] for i in self.config.target_layer_ids], dim=-1)

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """input_ids (1, L) -> candidate ids (1, L + n) and processed draft logits (1, n, V) (None when n = 0)."""
        cur_len = input_ids.shape[1]
        if is_first_iteration:  # the target has not run yet: no features, no drafts; the prefill is a plain step
            self.pending = None
            self.stats.num_prompt_tokens = cur_len
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("The target returned no hidden states; the drafter needs `output_hidden_states` support.")

        budget = min(self.config.block_size, self.max_length - cur_len - 1)
        if budget <= 0:  # the round's bonus token ends generation: nothing to draft
            self.pending = (cur_len, 0, [])
            return input_ids, None
        context = self._new_context(input_ids, model_outputs, n_last_matches)
        if self.gate is not None and not self.gate.should_draft([self.hint], [budget]):
            self.waiting.append(context)  # a plain step: these features go in with the next draft
            self.pending = (cur_len, 0, [])
            self.stats.gated_rounds += 1
            return input_ids, None
        context, self.waiting = torch.cat([*self.waiting, context], dim=1), []
        start = time.perf_counter()
        draft = self.draft(input_ids, context, model_kwargs, budget)
        if self.gate is not None:  # the admission read every survival back: the time includes the device's work
            self.hint = conditional_confidences(draft.survival)
            self.gate.record(time.perf_counter() - start, [self.hint])
        self.context_len = cur_len - 1
        candidate_ids = torch.cat([input_ids, draft.tokens.to(input_ids.device)], dim=-1)
        n = self._before_stop_string(candidate_ids, cur_len)
        self.pending = (cur_len, n, draft.survival)
        if n == 0:
            return input_ids, None
        set_verifying(self.target, True)  # the target's next forward verifies these drafts
        return candidate_ids[:, : cur_len + n], draft.logits[:, :n].float()

    def draft(self, input_ids, context, model_kwargs, budget: int) -> "DSparkBlockDraft":
        """Append `context` to the drafter's cache and draft at most `budget` (>= 1) tokens after `input_ids`.

        input_ids (1, L); context (1, n_new, m·d): target features of positions `context_len .. L - 2`. Returns the
        tokens (1, n), the processed logits (1, n, V) they were drawn from and the survivals examined.
        """
        raise NotImplementedError

    def _before_stop_string(self, candidate_ids, cur_len) -> int:
        """Number of drafts to keep so that no *draft* completes a stop string.

        The loop checks stopping criteria once per round, after committing accepted drafts and the bonus token; a
        stop string completed by an accepted draft would let later tokens through, unlike plain decoding. With this
        cut only the bonus (the round's last token) can complete it, and generation stops exactly where plain
        decoding does. EOS and max_length are clipped by the loop itself.
        """
        n = candidate_ids.shape[1] - cur_len
        if self.stop_strings is None:
            return n
        for j in range(1, n + 1):
            if bool(self.stop_strings(candidate_ids[:, : cur_len + j], None).any()):
                return j - 1
        return n

    def _key_padding(self, model_kwargs, n: int) -> torch.Tensor | None:
        """(1, n) boolean, False at padded prompt positions among the first n (left padding); None if none is."""
        mask = (model_kwargs or {}).get("attention_mask")
        if mask is None or bool(mask[:, :n].all()):
            return None
        return mask[:, :n].bool()

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Bookkeeping after the target's verify pass: acceptance statistics."""
        set_verifying(self.target, False)
        self.stats.num_new_tokens = input_ids.shape[1] - self.stats.num_prompt_tokens
        if self.pending is None:
            return  # the prefill: not a verify step
        proposed = self.pending[1]
        stopped = input_ids.shape[1] >= self.max_length or int(input_ids[0, -1]) in self.eos_ids
        self.stats.record_step(proposed, int(num_matches), stopped=stopped, survival=self.pending[2])


class DSparkCandidateGenerator(DrafterCandidateGenerator):
    """Drafts with a DSpark drafter (`config.model_type == "dspark"`): one parallel block pass, then token-by-token
    sampling through the sequential head under the admission policy (confidence threshold or Algorithm 1)."""

    def __init__(self, drafter, target, generation_config, logits_processor=None, input_ids=None, tokenizer=None):
        super().__init__(drafter, target, generation_config, logits_processor, input_ids, tokenizer)
        config = self.config
        sps = getattr(drafter, "sps_profile", None)
        if config.verify_policy == "scheduler" and config.confidence_head:
            # the checkpoint's sps_profile.json if it fits this target and hardware, else a quick profile
            sps = sps_for(drafter, target)
            if getattr(config, "draft_gate", True):
                self.gate = DraftGate(sps)
        self.admit = build_admission(config, sps)

    def draft(self, input_ids, context, model_kwargs, budget: int) -> "DSparkBlockDraft":
        # one parallel pass over [anchor, mask, ...] with the new context appended to the cache
        hidden = self._draft_block(input_ids[:, -1:], context, model_kwargs)
        # schedule: sample token by token, stopping where verification stops paying
        return self.drafter.sample_block(
            hidden, input_ids, self.lm_head, self.logits_processor, self.do_sample, max_tokens=budget, admit=self.admit
        )

    def _draft_block(self, anchor, context, model_kwargs) -> torch.Tensor:
        """Backbone pass; returns h (1, γ, d). The cache keeps the context and drops the block's own K/V."""
        drafter, gamma = self.drafter, self.config.block_size
        device = drafter.fc.weight.device
        start = self.context_len
        n_ctx = context.shape[1]
        # Context entry i sits at position start + i; block slot j at the anchor's position + j.
        position_ids = torch.arange(start, start + n_ctx + gamma, device=device)[None]
        mask = self._padding_mask(model_kwargs, start + n_ctx, gamma, device)
        out = drafter(
            noise_embeds=drafter.block_input_embeds(anchor.to(self.embed_tokens.weight.device), self.embed_tokens),
            context_hidden_states=context.to(device),
            position_ids=position_ids,
            attention_mask=mask,
            cache=self.cache,
        )
        self.cache.crop(-gamma)
        return out.last_hidden_state

    def _padding_mask(self, model_kwargs, n_context, gamma, device):
        """A key mask that hides padded prompt positions (left padding); None when nothing is padded."""
        keys = self._key_padding(model_kwargs, n_context)
        if keys is None:
            return None
        keys = torch.cat([keys, keys.new_ones(1, gamma)], dim=-1).to(device)
        return keys[:, None, None, :].expand(1, 1, gamma, -1)  # (1, 1, γ, K) boolean, True = visible


__all__ = ["DSparkCandidateGenerator", "DrafterCandidateGenerator"]
