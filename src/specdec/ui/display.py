"""Terminal rendering of decoding steps, like Figure 1 of Leviathan et al.

Accepted draft tokens are green, the first rejected draft token red and struck through, a token
the target chose after a rejection blue, a bonus token (all drafts accepted) cyan; tokens from a
plain target step are left uncoloured.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ..backends import Backend
from ..decoding.results import GenerationStats, Step

STYLES = {"accepted": "green", "rejected": "red strike", "resampled": "bold blue", "bonus": "bold cyan",
          "target": ""}

LEGEND = Text.assemble(("accepted draft", STYLES["accepted"]), "  ", ("rejected draft", STYLES["rejected"]), "  ",
                       ("target after rejection", STYLES["resampled"]), "  ", ("bonus", STYLES["bonus"]))


class StepPrinter:
    """An `on_step` callback that streams each step's tokens, coloured by their origin.

    Each token's text is found by decoding a short tail of the output (the last few printed
    tokens plus those not yet printed), so a step costs the same however long the output is.
    A token that ends inside a character (a byte-level BPE emoji split over tokens) prints
    nothing until the token that completes it; `flush()` prints what is still held back when
    the generation ends (`speculative_generate` and `autoregressive_generate` call it).
    `text` is everything printed so far except rejected drafts: `model.decode` of the emitted ids.
    """

    CONTEXT = 4  # printed tokens decoded again with each new one: a tokenizer may join text across tokens
    MAX_HELD = 16  # ids held back at most; a UTF-8 character spans at most 4 byte tokens

    def __init__(self, model: Backend, console: Console):
        self.model, self.console = model, console
        self.ids: list[int] = []
        self.text = ""
        self._printed = 0  # ids[:_printed] are in `text`
        self._starts = [0]  # ids positions where printed text ended on a whole character, oldest first

    def _piece(self, token: int) -> str:
        """Text that `token` adds after what was printed so far ("" while a character is incomplete)."""
        self.ids.append(token)
        start = self._starts[0]
        before = self.model.decode(self.ids[start:self._printed])
        after = self.model.decode(self.ids[start:])
        held = len(self.ids) - self._printed
        if after.endswith("\ufffd") and held < self.MAX_HELD:
            return ""  # an incomplete character: the next token may complete it
        self._printed = len(self.ids)
        self._starts = (self._starts + [self._printed])[-self.CONTEXT:]
        piece = after[len(before):]
        self.text += piece
        return piece

    def __call__(self, step: Step) -> None:
        line = Text()
        for token in step.emitted[:step.num_accepted]:
            line.append(self._piece(token), STYLES["accepted"])
        rejected = step.rejected_token
        if rejected is not None and len(step.emitted) > step.num_accepted:
            line.append(self.model.decode([rejected]), STYLES["rejected"])
        for token in step.emitted[step.num_accepted:]:
            line.append(self._piece(token), STYLES[step.next_kind])
        self.console.print(line, end="", soft_wrap=True, highlight=False)

    def flush(self) -> None:
        """Print what is held back (an output that ends inside a character shows it as decoded)."""
        if self._printed == len(self.ids):
            return
        start = self._starts[0]
        piece = self.model.decode(self.ids[start:])[len(self.model.decode(self.ids[start:self._printed])):]
        self._printed = len(self.ids)
        self._starts = (self._starts + [self._printed])[-self.CONTEXT:]
        self.text += piece
        self.console.print(Text(piece), end="", soft_wrap=True, highlight=False)


def summary_line(stats: GenerationStats, method: str) -> str:
    parts = [f"{stats.new_tokens} tokens in {stats.wall_seconds:.2f} s", f"{stats.tokens_per_second:.2f} tok/s"]
    if stats.lossy:
        parts.insert(0, f"LOSSY ({stats.lossy_reason}: not the target's distribution)")
    if stats.acceptance_rate is not None:
        parts.append(f"acceptance rate {stats.acceptance_rate:.1%} ({stats.accepted}/{stats.drafted})")
    if stats.alpha is not None:  # Leviathan's α, what `specdec theory --alpha` takes (docs/glossary.md)
        how = "Σ min(p, q)" if stats.alpha_source == "beta" else f"implied by tokens per drafting step at γ = {stats.fixed_gamma}"
        parts.append(f"α {stats.alpha:.3f} ({how})")
    parts.append(f"{stats.target_passes} target passes for {stats.new_tokens} tokens "
                 f"({stats.tokens_per_target_pass:.2f} per pass)")
    if method == "sd":
        parts.append(f"{stats.drafter_passes} drafter passes")
    if stats.loop_ms_per_step is not None:
        parts.append(f"loop {stats.loop_ms_per_step:.1f} ms/step")
    return " · ".join(parts)


class DebugPrinter:
    """An `on_step` callback for `speculative_generate(..., debug=True)`: one block per step with
    each draft token's q(x), p(x) and uniform draw u, the verdict, and the target's token; a token
    tree is drawn with its accepted path marked."""

    def __init__(self, model: Backend, console: Console):
        self.model, self.console = model, console
        self.number = 0

    def _token(self, token: int) -> str:
        return repr(self.model.decode([token], skip_special_tokens=False))

    def __call__(self, step: Step) -> None:
        self.number += 1
        info = step.info
        head = Text(f"step {self.number}: drafted {len(step.draft_tokens)}", style="bold")
        if info.get("gamma") is not None:
            head.append(f", γ = {info['gamma']}")
        if info.get("h_norm") is not None:
            head.append(f", H_norm = {info['h_norm']:.3f}")
        if info.get("threshold") is not None:
            head.append(f", θ = {info['threshold']:.2f}")
        self.console.print(head, highlight=False)
        if step.tree_parents is not None:
            self._tree(step)
            return
        for i, token in enumerate(step.draft_tokens):
            if i > step.num_accepted:
                break  # drafts after the first rejection were never judged
            verdict, style = ("accept", STYLES["accepted"]) if i < step.num_accepted else ("reject", STYLES["rejected"])
            numbers = ""
            if "p" in info:
                u = info["u"][i] if info.get("u") is not None else None
                numbers = f"  q={info['q'][i]:.3f} p={info['p'][i]:.3f}" + (f" u={u:.3f}" if u is not None else "")
            self.console.print(Text.assemble(f"  {self._token(token):>16}", numbers, "  ", (verdict, style)),
                               highlight=False)
        self.console.print(Text.assemble(f"  {self._token(step.next_token):>16}  ",
                                         (step.next_kind, STYLES[step.next_kind] or "bold")), highlight=False)

    def _tree(self, step: Step) -> None:
        """A token tree, one node a line indented by depth: the accepted path, the children the
        walk tried and turned down, and (dim) the nodes it never reached; then the target's token."""
        info, path, parents = step.info, step.path or [], step.tree_parents
        on_path = set(path)
        tried = {i for i, parent in enumerate(parents) if parent == -1 or parent in on_path}
        depth: list[int] = []
        for i, token in enumerate(step.draft_tokens):
            depth.append(0 if parents[i] < 0 else depth[parents[i]] + 1)
            if i in on_path:
                verdict, style = "accept", STYLES["accepted"]
            elif i in tried:
                verdict, style = "reject", STYLES["rejected"]
            else:
                verdict, style = "not reached", "dim"
            numbers = ""
            if info.get("p") is not None and i in tried:
                u = info["u"][i] if info.get("u") is not None else None
                numbers = f"  q={info['q'][i]:.3f} p={info['p'][i]:.3f}" + (f" u={u:.3f}" if u is not None else "")
            self.console.print(Text.assemble("  " + "  " * depth[i] + f"{self._token(token)}", numbers, "  ",
                                             (verdict, style)), highlight=False)
        self.console.print(Text.assemble(f"  {'  ' * len(path)}{self._token(step.next_token)}  ",
                                         (step.next_kind, STYLES[step.next_kind] or "bold")), highlight=False)
