"""The trainer's vocabulary projection, blocked (`ProjectedLogprobs`) vs whole-chunk logits, side by side in one run.

Both paths are the library's own `token_logprobs`: a plain `nn.Linear` head takes the blocked path; the same
head wrapped in a module takes the path every other head takes (the chunk's (tokens, vocab) float32 logits,
recomputed in backward). Per path and mode it prints the best of `--repeats` times of a no-grad pass (what
reference and old-policy logprobs cost) and of forward + backward (what training costs), under bf16 autocast
where the CPU has native bf16 (as `precision="auto"` runs it), the ratio of the two paths, and the largest
difference of their logprobs and gradients.

    python benchmarks/logprob_head.py                        # SmolLM2-135M's head (49152 x 576), 2048 tokens
    python benchmarks/logprob_head.py --tokens 512 --entropy
"""

from __future__ import annotations

import argparse
import time

import torch

from training.utils.models.load import default_device, native_bf16
from training.utils.trainer.logprob_head import token_logprobs


class WrappedHead(torch.nn.Module):
    """The same weights behind a module that is not an `nn.Linear`: the whole-chunk path."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, hidden):
        return self.linear(hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--tokens", type=int, default=2048, help="positions projected per call")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="TrainerConfig.logprob_chunk_tokens")
    parser.add_argument("--entropy", action="store_true", help="also the entropy (and its gradient)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = default_device()
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device)
    head.weight.data.normal_(0, 0.02)
    hidden = torch.randn(args.tokens, args.hidden, device=device, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device)
    autocast = native_bf16(device)
    print(f"head {args.vocab} x {args.hidden}, {args.tokens} tokens in chunks of {args.chunk_tokens}, "
          f"device={device}, bf16 autocast={autocast}, entropy={args.entropy}, threads={torch.get_num_threads()}, "
          f"torch {torch.__version__}")

    def run(module, backward: bool):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logprobs, entropy = token_logprobs(module, hidden, targets, 1.0, chunk_tokens=args.chunk_tokens,
                                               with_entropy=args.entropy)
        if backward:
            hidden.grad, head.weight.grad = None, None
            (logprobs.sum() + (entropy.sum() if args.entropy else 0)).backward()
        return logprobs.detach()

    def best(module, backward: bool) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            if backward:
                run(module, True)
            else:
                with torch.no_grad():
                    run(module, False)
            times.append(time.perf_counter() - start)
        return min(times)

    paths = {"whole-chunk logits": WrappedHead(head), "blocked": head}
    results = {name: (best(module, False), best(module, True)) for name, module in paths.items()}
    print(f"{'path':<20} {'no-grad s':>10} {'fwd+bwd s':>10}")
    for name, (no_grad, train) in results.items():
        print(f"{name:<20} {no_grad:>10.3f} {train:>10.3f}")
    (old_ng, old_tr), (new_ng, new_tr) = results.values()
    print(f"speed-up of blocked: no-grad {old_ng / new_ng:.2f}x, fwd+bwd {old_tr / new_tr:.2f}x")

    outputs = []
    for module in paths.values():
        logprobs = run(module, True)
        outputs.append((logprobs, hidden.grad.clone(), head.weight.grad.clone()))
    (lp_a, gh_a, gw_a), (lp_b, gh_b, gw_b) = outputs
    print(f"max |logprob diff| {(lp_a - lp_b).abs().max().item():.2e}; gradient diff / max |gradient|: "
          f"hidden {((gh_a - gh_b).abs().max() / gh_a.abs().max()).item():.2e}, "
          f"head weight {((gw_a - gw_b).abs().max() / gw_a.abs().max()).item():.2e}")


if __name__ == "__main__":
    main()
