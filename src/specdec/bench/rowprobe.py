"""`python -m specdec.bench.rowprobe --config DIR [--device cuda]`: are row-exact passes exact on
this device, what does each of their fixes buy, and what do they cost?

It builds a model of a Hugging Face config's shape with random weights (no weights need to reach
the machine: a GPU lent without our models can run it), bf16, and reports:

- row gap: max |logits of one pass over w tokens - logits of w one-token passes|, and how many
  argmaxes differ, for a plain target and a row-exact one (backends/rows.py);
- batch gap: the same between sequences scored together (`forward_batch`) and alone;
- the power checks on CUDA: the row-exact target with its GEMMs and norms on the pass's own rows
  (no `kernels.CUDA_ROWS` padding), then with only its norms unfixed;
- pass time (ms, `passcost`'s median of 15) by width, plain and row-exact, and of batched
  passes of n sequences x w rows.

`--captured` measures captured passes (backends/captured.py) instead: their exactness, their cost
against the GPU's memory floor, the engine's batched throughput and transformers' `generate`
beside them (bench/graphs.py).

docs/kernels.md, "Row-exact passes on CUDA" and "Captured passes on CUDA", holds its numbers.
"""

from __future__ import annotations

import argparse
import copy

import torch

from ..backends.transformers import TransformersModel
from ..backends import kernels
from ..sizing.pass_costs import batch_pass_seconds, pass_seconds
from .rowgap import batch_gap, row_gap


def _random(config_dir: str, device: str, layers: int | None):
    """A transformers model of the config's shape with random bf16 weights, on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config)
    hf = hf.to(torch.bfloat16).eval()
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(30.0)  # random init's logits are near-uniform: spread them
    return hf


def _model(config_dir: str, device: str, layers: int | None) -> tuple[TransformersModel, TransformersModel]:
    hf = _random(config_dir, device, layers)
    return (TransformersModel(copy.deepcopy(hf), None, "plain", exact_rows=False),
            TransformersModel(hf, None, "row-exact", exact_rows=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a folder with a Hugging Face config.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the config's")
    parser.add_argument("--captured", action="store_true",
                        help="(CUDA) captured passes against the memory floor instead (bench/graphs.py)")
    parser.add_argument("--drafter-config", default=None, help="(--captured) a drafter's config folder: its pass "
                        "cost and the speculative speedup the theory predicts")
    parser.add_argument("--alpha", type=float, default=0.878, help="(--captured) the pair's acceptance rate, "
                        "measured elsewhere (default: the default pair's on HumanEval, docs/benchmarks.md)")
    parser.add_argument("--sections", default="exactness,cost,theory,engine,peers",
                        help="(--captured) which of exactness, cost, theory, engine, peers, eager to run")
    parser.add_argument("--json", default=None, help="(--captured) append each section's record to this file")
    args = parser.parse_args(argv)
    if args.captured:
        return _captured(args)
    plain, exact = _model(args.config, args.device, args.layers)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}, "
          f"{args.config} with random weights, bf16", flush=True)
    vocab = plain.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (200,), generator=generator).tolist()
    more = torch.randint(0, vocab, (64,), generator=generator).tolist()

    def gaps(label: str, model: TransformersModel) -> None:
        rows = ", ".join(f"{w}: {gap:.3g} ({flips} flips)" for w in (2, 4, 6, 16)
                         for gap, flips in [row_gap(model, prompt, more, w)])
        batch = "" if not model.exact_rows else ", batch gap " + ", ".join(
            f"{n}x{w}: {batch_gap(model, prompt, more, n, w):.3g}" for n, w in ((8, 1), (8, 6), (16, 4)))
        print(f"{label}: row gap by width {rows}{batch}", flush=True)

    gaps("plain", plain)
    gaps("row-exact", exact)
    if args.device.startswith("cuda"):
        fixed = kernels.fixed_row_calls
        kernels.fixed_row_calls = lambda function, flat, rows: function(flat)  # every call on the pass's own rows
        try:
            gaps("row-exact, no fixed rows", exact)
        finally:
            kernels.fixed_row_calls = fixed
        norms = [m for m in exact.hf.modules() if getattr(type(m), "_rows_fixed", False)]
        for norm in norms:
            norm.__class__ = type(norm).__mro__[1]
        gaps("row-exact, GEMMs fixed, norms not", exact)
        for norm in norms:
            norm.__class__ = kernels._row_stable_norm(type(norm))

    for model in (plain, exact):  # `passcost`'s timings: medians of 15 after a warm-up, after 200 cached ids
        print(f"pass ms, {model.name}, by width: " +
              ", ".join(f"{w}: {1e3 * pass_seconds(model, w, context=200, repeats=15):.1f}"
                        for w in (1, 2, 4, 6, 8, 16, 32)), flush=True)
    print("batched pass ms, row-exact, sequences x width: " +
          ", ".join(f"{n}x{w}: {1e3 * batch_pass_seconds(exact, n, w, context=200, repeats=15):.1f}"
                    for n, w in ((1, 1), (4, 1), (8, 1), (16, 1), (8, 6), (16, 6))), flush=True)


def _captured(args) -> None:
    """`--captured`: bench/graphs.py's sections on random bf16 weights of the config's shape."""
    from .graphs import Report, run

    hf = _random(args.config, args.device, args.layers)
    drafter = _random(args.drafter_config, args.device, args.layers) if args.drafter_config else None
    report = Report(args.json)
    sections = set(args.sections.split(","))
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (eager passes: a smoke run)"
    report("setup", f"torch {torch.__version__}, {gpu}, {args.config} with random weights "
           "(bf16; no real weights reach this machine)", torch=torch.__version__, gpu=gpu,
           config=args.config, drafter_config=args.drafter_config)

    def eager():  # copies: our attention, installed on a wrapped model, is no model transformers compiles
        return (TransformersModel(copy.deepcopy(hf), None, "plain", exact_rows=False),
                TransformersModel(copy.deepcopy(hf), None, "row-exact", exact_rows=True))
    run(hf, drafter, report, args.alpha, eager if "eager" in sections else None, sections)


if __name__ == "__main__":
    main()
