"""`specdec chat`: an interactive conversation with switchable method, drafter, schedule and sampler.

The session holds the settings and the history; `handle(line)` runs one command or one turn, so
the whole thing can be driven (and tested) without a terminal.
"""

from __future__ import annotations

from typing import Callable

from rich.console import Console

from ..backends import Backend
from .display import DebugPrinter, StepPrinter, summary_line
from ..errors import SpecdecError
from ..decoding.results import GenerationStats
from ..decoding.loop import autoregressive_generate, speculative_generate
from ..decoding.speculation import Parts, Speculation, build, from_options, open_files
from ..sizing.pass_costs import pass_costs
from ..core.samplers import Sampler
from ..sizing.schedules import SCHEDULES, make_schedule

HELP = """commands:
  /method NAME             any of `specdec methods` (default, chain, lookup, tree-mixed, sd, ar, ...)
  /drafter NAME            a model (registry name, directory, .gguf), ngram, lookup, suffix, or the
                           target drafting for itself: medusa:DIR, eagle:DIR, self-skip[:LAYERS]
  /tree SHAPE              the tree method's shape (sides, eagle2, sequoia, lookup, mixed, ...)
  /schedule NAME           cost, fixed, heuristic, confidence, egag
  /gamma N                 γ (fixed; start of heuristic)     /gamma-max N   (the others)
  /temperature T           0 = greedy                        /top-k K   /top-p P
  /debug on|off            the step view: q, p, u per draft token
  /stats                   the last reply's and the session's numbers
  /reset                   forget the conversation           /help   /quit"""


class ChatSession:
    """method: a method or preset (`speculation.resolve`), with `drafter` (a --drafter value) and
    `tree` on top as `speculation.from_options` reads them; schedule None: the method's.
    load_drafter(name): the drafter model of that name, loaded (called once a name)."""

    def __init__(self, target: Backend, load_drafter: Callable[[str], Backend], drafter: str,
                 console: Console, method: str = "default", schedule: str | None = None, gamma: int | None = None,
                 gamma_max: int | None = None, sampler: Sampler | None = None, debug: bool = False,
                 max_new_tokens: int = 256, tree: str = "off"):
        self.target, self.load_drafter, self.console = target, load_drafter, console
        self.method, self.schedule, self.gamma, self.gamma_max = method, schedule, gamma, gamma_max
        self.tree = tree
        self.sampler = sampler or Sampler(temperature=0.0)
        self.debug, self.max_new_tokens = debug, max_new_tokens
        self.history: list[dict] = []
        self.last: GenerationStats | None = None
        self.total_tokens, self.total_seconds = 0, 0.0
        self._models: dict[str, object] = {}
        self._built: dict = {}
        self.drafter_name = drafter

    def config(self):
        """The `SpecConfig` of the session's settings (SpecdecError where they do not fit together)."""
        return from_options(self.method, self.drafter_name, self.tree, schedule=self.schedule, gamma=self.gamma,
                            gamma_max=self.gamma_max)

    def speculation(self) -> Speculation:
        """The session's speculation, built once per config: its files opened, its drafter model
        loaded (once a name) and, for the cost schedule, this machine's pass costs."""
        config = self.config()
        if config not in self._built:
            open_files(config)
            model = None
            if config.speculative and config.needs_drafter_model():
                if config.drafter not in self._models:
                    self._models[config.drafter] = self.load_drafter(config.drafter)
                model = self._models[config.drafter]
            say = lambda m: self.console.print(f"[dim]{m}[/]", highlight=False)  # noqa: E731
            self._built[config] = build(config, Parts(self.target, model,
                                                      costs=lambda m: pass_costs(self.target, m, say=say)))
        return self._built[config]

    def handle(self, line: str) -> bool:
        """Run one command or one conversation turn; False when the session should end."""
        line = line.strip()
        if not line:
            return True
        if line.startswith("/"):
            return self._command(line)
        self._turn(line)
        return True

    def _command(self, line: str) -> bool:
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        try:
            if name in ("quit", "exit"):
                return False
            if name == "help":
                self.console.print(HELP, highlight=False)
            elif name in ("method", "drafter", "tree"):
                if not arg:
                    raise SpecdecError(f"/{name} takes a name; /help lists what each takes")
                attribute = "drafter_name" if name == "drafter" else name
                before = getattr(self, attribute)
                setattr(self, attribute, arg)
                try:
                    self.speculation()  # load now, so a bad name fails here and not mid-turn
                except SpecdecError:
                    setattr(self, attribute, before)
                    raise
            elif name == "schedule":
                if arg not in SCHEDULES:
                    raise SpecdecError(f"/schedule takes one of {', '.join(SCHEDULES)}")
                self.schedule = arg
            elif name in ("gamma", "gamma-max", "top-k"):
                value = _number(arg, int, name)
                if name == "top-k":
                    self.sampler = Sampler(self.sampler.temperature, value, self.sampler.top_p)
                else:
                    make_schedule("fixed", value)  # validates
                    setattr(self, name.replace("-", "_"), value)
            elif name in ("temperature", "top-p"):
                value = _number(arg, float, name)
                s = self.sampler
                self.sampler = Sampler(value, s.top_k, s.top_p) if name == "temperature" else Sampler(
                    s.temperature, s.top_k, value)
            elif name == "debug":
                if arg not in ("on", "off"):
                    raise SpecdecError("/debug takes on or off")
                self.debug = arg == "on"
            elif name == "stats":
                self._stats()
            elif name == "reset":
                self.history = []
            else:
                raise SpecdecError(f"unknown command /{name}; /help lists them")
            if name not in ("help", "stats", "quit"):
                self.console.print(f"[dim]{self.describe()}[/]", highlight=False)
        except SpecdecError as exc:
            self.console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return True

    def describe(self) -> str:
        weights = f"weights {self.target.weights}"
        config = self.config()
        if not config.speculative:
            return f"ar · {self.sampler.describe()} · {weights}"
        sizing = self.speculation().describe_sizing()
        name = "sd" if self.method == "default" else self.method
        return (f"{name} · drafter {self.drafter_name} · {sizing} · {self.sampler.describe()} · {weights}" +
                (" · debug" if self.debug else ""))

    def _turn(self, text: str) -> None:
        messages = self.history + [{"role": "user", "content": text}]
        ids = self.target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        try:
            config = self.config()
            if config.speculative:
                printer = DebugPrinter(self.target, self.console) if self.debug else StepPrinter(self.target, self.console)
                result = speculative_generate(list(ids), self.target, self.speculation(), sampler=self.sampler,
                                              max_new_tokens=self.max_new_tokens, on_step=printer, debug=self.debug)
            else:
                result = autoregressive_generate(list(ids), self.target, sampler=self.sampler,
                                                 max_new_tokens=self.max_new_tokens,
                                                 on_step=StepPrinter(self.target, self.console))
        except SpecdecError as exc:
            self.console.print(f"[bold red]error:[/] {exc}", highlight=False)
            return
        self.console.print()
        self.history = messages + [{"role": "assistant", "content": self.target.decode(result.tokens)}]
        self.last = result.stats
        self.total_tokens += result.stats.new_tokens
        self.total_seconds += result.stats.wall_seconds
        self.console.print(f"[dim]{summary_line(result.stats, self._shown())}[/]", highlight=False)

    def _shown(self) -> str:
        return "ar" if self.method == "ar" else "sd"

    def _stats(self) -> None:
        if self.last is None:
            self.console.print("no reply yet", highlight=False)
            return
        self.console.print(f"last reply: {summary_line(self.last, self._shown())}", highlight=False)
        rate = self.total_tokens / self.total_seconds if self.total_seconds else 0.0
        self.console.print(f"session: {self.total_tokens} tokens in {self.total_seconds:.2f} s ({rate:.2f} tok/s), "
                           f"{len(self.history) // 2} turns", highlight=False)


def _number(text: str, kind, name: str):
    try:
        return kind(text)
    except ValueError:
        raise SpecdecError(f"/{name} takes a number, got {text!r}") from None
