"""`python -m specdec.bench.rowprobe --config DIR [--device cuda]`: are row-exact passes exact on
this device, what does each of their fixes buy, and what do they cost?

It builds a model of a Hugging Face config's shape with random weights (no weights need to reach
the machine: a GPU lent without our models can run it), bf16, and reports:

- row gap: max |logits of one pass over w tokens - logits of w one-token passes|, and how many
  argmaxes differ, for a plain target and a row-exact one (rows.py);
- batch gap: the same between sequences scored together (`forward_batch`) and alone;
- the power checks on CUDA: the row-exact target with its GEMMs and norms on the pass's own rows
  (no `kernels.CUDA_ROWS` padding), then with only its norms unfixed;
- pass time (ms, `passcost`'s median of 15) by width, plain and row-exact, and of batched
  passes of n sequences x w rows.

docs/kernels.md, "Row-exact passes on CUDA", holds its numbers.
"""

from __future__ import annotations

import argparse
import copy

import torch

from ..backends import Segment
from ..backends.transformers import TransformersModel
from .. import kernels
from ..passcost import batch_pass_seconds, pass_seconds


def _model(config_dir: str, device: str, layers: int | None) -> tuple[TransformersModel, TransformersModel]:
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
    return (TransformersModel(copy.deepcopy(hf), None, "plain", exact_rows=False),
            TransformersModel(hf, None, "row-exact", exact_rows=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a folder with a Hugging Face config.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the config's")
    args = parser.parse_args(argv)
    plain, exact = _model(args.config, args.device, args.layers)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}, "
          f"{args.config} with random weights, bf16", flush=True)
    vocab = plain.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (200,), generator=generator).tolist()
    more = torch.randint(0, vocab, (64,), generator=generator).tolist()

    def row_gap(model: TransformersModel, width: int) -> tuple[float, int]:
        one = model.new_cache()
        pending = model.prefill(prompt, one)
        singles = torch.cat([model.forward(pending, one, 1)] + [model.forward([t], one, 1) for t in more[:width - 1]])
        wide = model.new_cache()
        model.prefill(prompt, wide)
        multi = model.forward(pending + more[:width - 1], wide, width)
        return float((singles - multi).abs().max()), int((singles.argmax(-1) != multi.argmax(-1)).sum())

    def batch_gap(model: TransformersModel, sequences: int, width: int) -> float:
        alone, segments = [], []
        for i in range(sequences):
            cache = model.new_cache()
            pending = model.prefill(prompt[i:], cache)
            alone.append(model.forward(pending + more[:width - 1], cache, width))
            cache = model.new_cache()
            segments.append(Segment(model.prefill(prompt[i:], cache) + more[:width - 1], cache, width))
        together = model.forward_batch(segments)
        return max(float((a - b).abs().max()) for a, b in zip(alone, together))

    def gaps(label: str, model: TransformersModel) -> None:
        rows = ", ".join(f"{w}: {gap:.3g} ({flips} flips)" for w in (2, 4, 6, 16) for gap, flips in [row_gap(model, w)])
        batch = "" if not model.exact_rows else \
            ", batch gap " + ", ".join(f"{n}x{w}: {batch_gap(model, n, w):.3g}" for n, w in ((8, 1), (8, 6), (16, 4)))
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


if __name__ == "__main__":
    main()
