"""A picture of speculation: a reply's text with each token coloured by how it was committed.

`origins` is `DSparkGenerationStats.token_origins()` (`decoding/stats.py`): ("target", 0) for the target's own token
(the prefill's first and each verify pass's bonus), ("drafter", k) or ("lookup", k) for a draft accepted at depth k.
A drafter's drafts are shaded from light green (depth 1) to deep green, a lookup's are blue, the target's own tokens
are left uncoloured. One legend line follows, with the counts and τ: tokens committed per verify pass, the bonus
included and the prefill's token and forward left out, as `DSparkGenerationStats.acceptance_length`.
"""

import html


GREENS = (157, 120, 83, 77, 71, 34, 28, 22)  # ANSI 256 colours, depth 1, 2, ...; deeper drafts keep the last
LOOKUP = 75
GREENS_HTML = ("#d9f7d9", "#b4ecb4", "#8edc8e", "#66c866", "#42b042", "#2a942a", "#1b781b", "#0f5c0f")
LOOKUP_HTML = "#bfe0ff"
RESET = "\x1b[0m"


def origins_from(stats) -> list[tuple[str, int]]:
    """How each new token of a one-row `generate()` call was committed (`stats`: `drafter.generation_stats`)."""
    return stats.token_origins()


def rounds_from(stats) -> list[int]:
    """The tokens each verify pass committed (the prefill left out), for `render_reply(..., rounds=)`."""
    return list(stats.committed)


def token_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """The text of `tokenizer.decode(token_ids)` split among the tokens: each token owns the characters its
    prefix's decoding adds. A character made of several byte-level tokens (a prefix ending inside it decodes to
    U+FFFD) belongs to the token that completes it, so `"".join(pieces) == tokenizer.decode(token_ids)`."""
    text = tokenizer.decode(token_ids)
    pieces, done = [], 0
    for i in range(1, len(token_ids) + 1):
        prefix = text if i == len(token_ids) else tokenizer.decode(token_ids[:i])
        common = next((j for j, (a, b) in enumerate(zip(prefix, text)) if a != b), min(len(prefix), len(text)))
        end = max(done, common)  # a decoding that rewrites earlier text (rare) gives its characters to this token
        pieces.append(text[done:end])
        done = end
    return pieces


def _counts(origins: list[tuple[str, int]], rounds: list[int] | None) -> dict:
    """Tokens by origin, verify passes and τ. Without `rounds` the verify passes are the target's tokens after the
    prefill's: a last pass cut by EOS or the length limit before its bonus is then not counted."""
    kinds = [kind for kind, _ in origins]
    unknown = set(kinds) - {"target", "drafter", "lookup"}
    if unknown:
        raise ValueError(
            f"origins must be ('target' | 'drafter' | 'lookup', depth) pairs, got kinds {sorted(unknown)}."
        )
    after_prefill = max(len(origins) - 1, 0)
    if rounds is None:
        verifies = max(kinds.count("target") - 1, 0)
    elif sum(rounds) != after_prefill:
        raise ValueError(
            f"rounds (tokens per verify pass) sum to {sum(rounds)}, but {after_prefill} tokens follow the prefill's."
        )
    else:
        verifies = len(rounds)
    return {
        "drafter": kinds.count("drafter"),
        "lookup": kinds.count("lookup"),
        "target": kinds.count("target"),
        "verifies": verifies,
        "tau": after_prefill / verifies if verifies else None,
        "depth": max([depth for kind, depth in origins if kind == "drafter"], default=0),
    }


def _legend(counts: dict, shade) -> str:
    """The legend line; `shade(text, kind, depth)` colours a label the way the reply's tokens of that kind are."""
    depths = " ".join(shade(str(k), "drafter", k) for k in range(1, counts["depth"] + 1))
    tau = f"{counts['tau']:.2f}" if counts["tau"] is not None else "n/a"
    return (
        f"{shade('drafter', 'drafter', 1)} {counts['drafter']} (depth {depths or '-'})  "
        f"{shade('lookup', 'lookup', 1)} {counts['lookup']}  {shade('target', 'target', 0)} {counts['target']}  "
        f"τ = {tau} tokens per verify pass ({counts['verifies']} passes, the prefill's token and forward left out)"
    )


def _check(token_ids, origins) -> None:
    if len(token_ids) != len(origins):
        raise ValueError(f"token_ids ({len(token_ids)}) and origins ({len(origins)}) must have one entry per token.")


def _ansi(text: str, kind: str, depth: int) -> str:
    if kind == "target" or not text:
        return text
    code = LOOKUP if kind == "lookup" else GREENS[min(depth, len(GREENS)) - 1]
    return f"\x1b[38;5;{code}m{text}{RESET}"


def render_reply(
    tokenizer,
    token_ids: list[int],
    origins: list[tuple[str, int]],
    color: bool = True,
    rounds: list[int] | None = None,
) -> str:
    """The reply's text, each token coloured by how it was committed (ANSI 256 colours), then one legend line.

    token_ids: the new tokens of a one-row call; origins: one (kind, depth) per token (`origins_from(stats)`);
    color=False: plain text and a plain legend, no escape codes; rounds: the tokens each verify pass committed
    (`rounds_from(stats)`), which counts the verify passes exactly (without it a last pass cut short before its
    bonus is not counted). τ: tokens after the prefill's per verify pass, `DSparkGenerationStats.acceptance_length`.
    """
    _check(token_ids, origins)
    shade = _ansi if color else lambda text, kind, depth: text
    pieces = token_pieces(tokenizer, list(token_ids))
    text = "".join(shade(piece, kind, depth) for piece, (kind, depth) in zip(pieces, origins))
    return f"{text}\n{_legend(_counts(origins, rounds), shade)}"


def _html(text: str, kind: str, depth: int) -> str:
    text = html.escape(text)
    if kind == "target" or not text:
        return text
    background = LOOKUP_HTML if kind == "lookup" else GREENS_HTML[min(depth, len(GREENS_HTML)) - 1]
    ink = "#ffffff" if kind == "drafter" and depth > len(GREENS_HTML) // 2 else "#000000"
    return f'<span style="background:{background};color:{ink}" title="{kind} {depth}">{text}</span>'


def reply_html(tokenizer, token_ids: list[int], origins: list[tuple[str, int]]) -> str:
    """`render_reply` as HTML for a notebook (`IPython.display.HTML(reply_html(...))`): a span with an inline style
    per drafted token (the text escaped), the target's own tokens unstyled, and the legend below."""
    _check(token_ids, origins)
    pieces = token_pieces(tokenizer, list(token_ids))
    text = "".join(_html(piece, kind, depth) for piece, (kind, depth) in zip(pieces, origins))
    legend = _legend(_counts(origins, None), _html)
    return (
        f'<div style="font-family:monospace;white-space:pre-wrap">{text}</div>\n'
        f'<div style="font-family:monospace;font-size:smaller">{legend}</div>'
    )


__all__ = ["origins_from", "reply_html", "render_reply", "rounds_from", "token_pieces"]
