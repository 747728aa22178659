"""A/B a changed copy of the engine's C++ ops against the built ones, in one process.

    .venv/bin/python tools/ab_kernels.py --source OTHER.cpp [--source ...] [--decode 32x128,...]
        [--rounds 8] [--attention-layout token-major] [--linear-rows 1,16,32,256] [--cpu 0]
    .venv/bin/python tools/ab_kernels.py --pool-layouts head-major,token-major [--model DIR]
        [--decode ...] [--prefill ...]

Each ``--source`` is a copy of one file of ``tetri_server/engine/ops/`` (matched by its name:
``linear_ops.cpp``, ``ragged_attention.cpp``, ``prefill_attention.cpp``; ragged_attention needs
prefill_attention beside it, taken from the repo when not given). The copies are built into a
second library whose ops live under ``torch.ops.tetrix`` (same flags as the engine's build for
this CPU), so both versions run in the same process, one thread, pinned, CPU time:

- ``--decode BxC``: engine decode steps at batch B over C-token contexts (the
  ``bench_engine`` driver), alternating the engine's ops (A) and the copy's (B) round by round;
  the medians and B/A;
- ``--prefill``: the engine's prefill of a prompt of N tokens in one step, or ``N/C`` in steps
  of C tokens as a prefill worker chunks it (a comma list), A and B alternating round by round,
  best-of-3 per round; the medians and B/A;
- ``--attention BxC``: with a ragged_attention copy, the op alone on one layer's decode batch
  (B rows, each over C keys of its own; bench-model heads, or ``BxC:H/KxD``: H query heads over
  K KV heads of D, e.g. ``32x1024:8/2x128``), hot (the same KV again) and cold (after reading a
  256 MB buffer), A/B interleaved; outputs checked equal. Its pools have the layout
  ``--attention-layout`` names (head-major by default; token-major runs a copy's
  ``attend_token_major``);
- ``--linear-rows``: with a linear_ops copy, each linear of one bench-model layer (qkv, o,
  gate|up GLU, down) at those row counts, hot (the same weight again) and cold (one of 8
  copies, after reading a 256 MB buffer), A/B interleaved; outputs checked equal.

``--pool-layouts A,B`` runs the decode and prefill A/Bs on two engines whose KV pools have those
layouts (``kv.layout``), B with the copy's ops if a ``--source`` is given, else the built ones;
``--model`` picks the checkpoint (e.g. a GQA one made with tools/make_model.py --config).

To compare a past version: ``git show REV:tetri_server/engine/ops/linear_ops.cpp > /tmp/old.cpp``
then ``--source /tmp/old.cpp`` (B is then the old one). For kernel work, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tetri_server.bench.cpu import Timer  # noqa: E402
from tetri_server.bench.engine_driver import EngineDriver, pin  # noqa: E402
from tetri_server.engine import attention as attn  # noqa: E402
from tetri_server.engine.ops import SOURCES, build_spec, load_cpu_ops  # noqa: E402
from tetri_server.engine.ops import linear as lin  # noqa: E402
from tetri_server.engine.runner import ScheduledSeq, StepPlan  # noqa: E402
from tetri_server.engine.sequence import Sequence as Seq  # noqa: E402

LAYER = {"qkv": (1536, 512), "o": (512, 512), "gate|up": (2816, 512), "down": (512, 1408)}


def build_variant(sources: list[Path]) -> set[str]:
    """Build the copies as the ``tetrix`` library; returns the file names it replaces."""
    given = {p.name: p for p in sources}
    known = {p.name for p in SOURCES}
    if unknown := set(given) - known:
        raise SystemExit(f"--source must be named like one of {sorted(known)}: {sorted(unknown)}")
    if "ragged_attention.cpp" in given and "prefill_attention.cpp" not in given:
        given["prefill_attention.cpp"] = next(p for p in SOURCES
                                              if p.name == "prefill_attention.cpp")
    _, flags, _ = build_spec()
    out = Path(tempfile.mkdtemp(prefix="tetrix-"))
    files = []
    for name, path in given.items():
        code = re.sub(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(tetri,", r"TORCH_LIBRARY\1(tetrix,",
                      path.read_text())
        (out / name).write_text(code.replace("tetri_ops", "tetrix_ops"))
        files.append(str(out / name))
    from torch.utils.cpp_extension import load

    load(name="tetrix_ops", sources=files, extra_cflags=flags, extra_ldflags=["-fopenmp"],
         build_directory=str(out), is_python_module=False)
    if "linear_ops.cpp" in given and hasattr(torch.ops.tetrix, "set_packed_linear_tall_rows"):
        # the copy's tiles as linear.py sets the engine's for this CPU (a copy may change it)
        lin.tetri_linear_supported()
        torch.ops.tetrix.set_packed_linear_tall_rows(torch.ops.tetri.packed_linear_tall_rows())
    return set(given)


def variant_kernels(kern: object, replaced: set[str]) -> object:
    x = torch.ops.tetrix
    changes: dict[str, Callable[..., torch.Tensor]] = {}
    if "linear_ops.cpp" in replaced:
        def linear(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                   packed: torch.Tensor | None = None) -> torch.Tensor:
            if packed is not None and packed.dim() == 3 and a.dim() == 2:
                return x.packed_linear(a, packed, b, w.shape[0])
            return lin.linear(a, w, b, packed)

        def glu(a: torch.Tensor, w: torch.Tensor,
                packed: torch.Tensor | None = None) -> torch.Tensor:
            if packed is not None and packed.dim() == 4 and a.dim() == 2:
                return x.packed_glu(a, packed, w.shape[0] // 2)
            return lin.glu(a, w, packed)

        changes.update(linear=linear, glu=glu)
    if "ragged_attention.cpp" in replaced:
        def attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                      meta: attn.BatchMetadata, scale: float | None = None,
                      window: int = 0) -> torch.Tensor:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            x.ragged_attention(q, pool_k, pool_v, out, *meta.seq_tensors,
                               scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                               window)
            return out

        def write_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, meta: attn.BatchMetadata) -> None:
            if meta.num_real:
                x.write_kv(pool_k, pool_v, k, v, meta.slot_mapping)

        changes.update(attention=attention, write_kv=write_kv)
    return dataclasses.replace(kern, **changes)  # type: ignore[type-var]


@dataclasses.dataclass
class Arm:
    """One side of an A/B: an engine and the kernel set its model runs."""

    drv: EngineDriver
    kernels: object

    def use(self) -> EngineDriver:
        self.drv.eng.model.kernels = self.kernels  # type: ignore[attr-defined]
        return self.drv


# (max batch, max context) -> the two arms, each an engine with a pool that large
MakeArms = Callable[[int, int], tuple[Arm, Arm]]


def make_arms(model: Path, replaced: set[str], layouts: tuple[str, str] | None) -> MakeArms:
    """A: the built ops; B: the copy's (``replaced``), or the built ones when there is no copy.
    With ``layouts``, A's engine has a KV pool of the first layout and B's another of the
    second (two engines); else one engine (``kv.layout`` auto) runs both."""
    def arms(max_batch: int, max_ctx: int) -> tuple[Arm, Arm]:
        def engine(*sets: str) -> EngineDriver:
            return EngineDriver(Timer(kind="cpu"), model, max_batch, max_ctx, 40, sets=sets)

        a_drv = engine(f"kv.layout={layouts[0]}") if layouts else engine()
        b_drv = engine(f"kv.layout={layouts[1]}") if layouts else a_drv
        built = a_drv.eng.model.kernels  # type: ignore[attr-defined]
        return Arm(a_drv, built), Arm(b_drv, variant_kernels(built, replaced) if replaced
                                      else built)
    return arms


def interleaved_ms(a: Arm, b: Arm, rounds: int,
                   measure: Callable[[EngineDriver], list[float]]) -> tuple[float, float, float]:
    """``measure`` on arm A and arm B, alternating round by round (the order flipped every other
    round); the median ms of each, and the median over rounds of B's median / A's in that round
    (paired: the machine's speed drifts over minutes here, and a round's A and B ran seconds
    apart)."""
    times: dict[str, list[float]] = {"A": [], "B": []}
    ratios = []
    try:
        for r in range(rounds):
            got = {}
            for key, arm in (("A", a), ("B", b)) if r % 2 == 0 else (("B", b), ("A", a)):
                got[key] = measure(arm.use())
                times[key] += got[key]
            ratios.append(statistics.median(got["B"]) / statistics.median(got["A"]))
    finally:
        a.use()  # the built ops again on A's engine (B's, when it has its own, is left as is)
    return (1e3 * statistics.median(times["A"]), 1e3 * statistics.median(times["B"]),
            statistics.median(ratios))


def ab_decode(configs: list[tuple[int, int]], rounds: int, arms: MakeArms) -> None:
    a, b = arms(max(b for b, _ in configs), max(c for _, c in configs))
    print("| decode step | A ms | B ms | B/A | B/A paired |\n"
          "|---|---:|---:|---:|---:|")
    for batch, ctx in configs:
        def steps(drv: EngineDriver, batch: int = batch, ctx: int = ctx) -> list[float]:
            return drv.decode_step_times(batch, ctx, 12, 2, "ab")

        ma, mb, paired = interleaved_ms(a, b, rounds, steps)
        print(f"| B={batch} ctx={ctx} | {ma:.2f} | {mb:.2f} | {mb / ma:.3f} | **{paired:.3f}** |")


def ab_prefill(specs: list[str], rounds: int, arms: MakeArms) -> None:
    """``N`` (one step of a prompt of N tokens) or ``N/C`` (that prompt in steps of C tokens,
    each chunk after the first attending to the KV of those before it, as a prefill worker runs
    it)."""
    lens = [(int(n), int(c or n)) for n, _, c in (spec.partition("/") for spec in specs)]
    a, b = arms(1, max(n for n, _ in lens))
    print("| prefill | A ms | B ms | B/A | B/A paired |\n|---|---:|---:|---:|---:|")
    drivers = list(dict.fromkeys((a.drv, b.drv)))  # one or two engines
    for n, chunk in lens:
        seqs = {drv: drv.new_seq(n) for drv in drivers}  # the prompt in each engine's pool
        for drv, seq in seqs.items():
            if not drv.eng.kv_manager.reserve(seq, n):
                raise RuntimeError("KV pool too small for the prefill A/B")

        def best_of_3(drv: EngineDriver, n: int = n, chunk: int = chunk,
                      seqs: dict[EngineDriver, Seq] = seqs) -> list[float]:
            seq = seqs[drv]

            def run() -> None:
                seq.num_computed = 0
                for start in range(0, n, chunk):
                    drv.eng.runner.execute(StepPlan([ScheduledSeq(seq, min(chunk, n - start))]))

            run()  # warm-up
            return [min(drv.timer.timed(run, "ab") for _ in range(3))]

        ma, mb, paired = interleaved_ms(a, b, rounds, best_of_3)
        for drv, seq in seqs.items():
            drv.eng.kv_manager.free(seq)
        label = f"{n} tokens" + (f" in chunks of {chunk}" if chunk < n else "")
        print(f"| {label} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} | **{paired:.3f}** |")


def layer_call(lib: object, glu: bool, a: torch.Tensor, packs: list[torch.Tensor],
               n: int) -> Callable[[int], torch.Tensor]:
    """Weight copy i through ``lib``'s packed_glu / packed_linear (n output features)."""
    if glu:
        return lambda i: lib.packed_glu(a, packs[i], n // 2)  # type: ignore[attr-defined]
    return lambda i: lib.packed_linear(a, packs[i], None, n)  # type: ignore[attr-defined]


def eviction_buffer(nbytes: int = 256 << 20) -> torch.Tensor:
    """A buffer to read between a hot call and a cold one, so the cold one finds its data in
    DRAM. Written, not ``torch.empty``: the pages of an untouched buffer all map the kernel's
    one zero page, so reading it reads 4 KB over and over and evicts nothing (before
    session 55 "cold" here meant "still in L3" for anything under about 32 MB)."""
    return torch.ones(nbytes // 4)


def hot_cold_ms(fns: dict[str, Callable[[int | None], object]],
                rounds: int) -> dict[tuple[str, str], float]:
    """Median ms of A's and B's calls, hot (right after the same call) and cold (after reading
    a 256 MB buffer), A and B interleaved, the order flipped every other round. ``fns[key](r)``
    runs one call: r is None for a hot one, else the round (a cold call may use other data,
    e.g. another copy of the weight)."""
    big = eviction_buffer()
    times: dict[tuple[str, str], list[float]] = {}
    for rep in range(rounds):
        for key in ("A", "B") if rep % 2 else ("B", "A"):
            fns[key](None)
            t0 = time.process_time()
            fns[key](None)
            times.setdefault((key, "hot"), []).append(time.process_time() - t0)
            big.sum()
            t0 = time.process_time()
            fns[key](rep)
            times.setdefault((key, "cold"), []).append(time.process_time() - t0)
    return {kk: 1e3 * statistics.median(v) for kk, v in times.items()}


def hot_cold_cells(med: dict[tuple[str, str], float]) -> str:
    """The table cells "A / B ms | B/A" for hot, then cold."""
    return " | ".join(f"{med[('A', h)]:.3f} / {med[('B', h)]:.3f} | "
                      f"{med[('B', h)] / med[('A', h)]:.3f}" for h in ("hot", "cold"))


def ab_linears(rows: list[int], rounds: int) -> None:
    t, x = torch.ops.tetri, torch.ops.tetrix
    gen = torch.Generator().manual_seed(0)

    print("| rows | linear | MB | hot A / B ms | B/A | cold A / B ms | B/A |\n"
          "|---:|---|---:|---|---:|---|---:|")
    for m in rows:
        for name, (n, k) in LAYER.items():
            ws = [torch.randn(n, k, generator=gen) for _ in range(8)]
            a = torch.randn(m, k, generator=gen)
            glu = name == "gate|up"
            ps = [t.pack_glu_weight(w) if glu else t.pack_linear_weight(w) for w in ws]
            fns = {"A": layer_call(t, glu, a, ps, n), "B": layer_call(x, glu, a, ps, n)}
            if not torch.equal(fns["A"](0), fns["B"](0)):
                print(f"  note: {name} at {m} rows: the copy's output differs from the built op's")
            med = hot_cold_ms({key: lambda r, f=f: f(0 if r is None else 1 + r % 7)
                               for key, f in fns.items()}, rounds)
            print(f"| {m} | {name} | {n * k * 4 / 1e6:.1f} | {hot_cold_cells(med)} |")


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One ``--attention`` entry: ``BxC`` (the bench model's 8 heads of 64) or ``BxC:H/KxD``."""

    batch: int
    ctx: int
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64

    @classmethod
    def parse(cls, spec: str) -> AttentionShape:
        m = re.fullmatch(r"(\d+)x(\d+)(?::(\d+)/(\d+)x(\d+))?", spec.strip())
        if m is None:
            raise SystemExit(f"--attention: {spec!r} is not BxC or BxC:H/KxD")
        b, c, h, k, d = (int(v) if v else None for v in m.groups())
        assert b is not None and c is not None
        shape = cls(b, c) if h is None or k is None or d is None else cls(b, c, h, k, d)
        if min(shape.batch, shape.ctx, shape.kv_heads, shape.head_dim) < 1:
            raise SystemExit(f"--attention: {spec!r}: B, C, K and D must be at least 1")
        if shape.heads < 1 or shape.heads % shape.kv_heads:
            raise SystemExit(f"--attention: {spec!r}: H must be a positive multiple of K")
        return shape

    def __str__(self) -> str:
        heads = ("" if (self.heads, self.kv_heads, self.head_dim) == (8, 8, 64)
                 else f" {self.heads}/{self.kv_heads}x{self.head_dim}")
        return f"B={self.batch} ctx={self.ctx}{heads}"


def attention_pools(shape: AttentionShape, layout: str,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pools ``[kv_heads, batch * ctx, head_dim]`` of ``layout``: head-major
    (each head's rows one run) or token-major (a token's heads side by side), as the engine's."""
    tokens = shape.batch * shape.ctx
    if layout == "token-major":
        kv = torch.randn(2, tokens, shape.kv_heads, shape.head_dim, generator=gen).transpose(1, 2)
    else:
        kv = torch.randn(2, shape.kv_heads, tokens, shape.head_dim, generator=gen)
    return kv[0], kv[1]


def ab_attention(configs: list[AttentionShape], rounds: int,
                 layout: str = "head-major") -> None:
    t, x = torch.ops.tetri, torch.ops.tetrix
    gen = torch.Generator().manual_seed(0)
    print(f"| decode attention ({layout} pool) | KV MB | hot A / B ms | B/A | cold A / B ms | B/A "
          "| cold A GB/s |\n|---|---:|---|---:|---|---:|---:|")
    for shape in configs:
        batch, ctx, d = shape.batch, shape.ctx, shape.head_dim
        pool_k, pool_v = attention_pools(shape, layout, gen)
        q = torch.randn(batch, shape.heads, d, generator=gen)
        meta = (torch.arange(batch), torch.ones(batch, dtype=torch.long),
                torch.full((batch,), ctx), torch.arange(batch) * ctx)
        outs = {"A": torch.empty_like(q), "B": torch.empty_like(q)}
        fns = {key: functools.partial(lib.ragged_attention, q, pool_k, pool_v, outs[key], *meta,
                                      1.0 / math.sqrt(d), 0)
               for key, lib in (("A", t), ("B", x))}
        fns["A"]()
        fns["B"]()
        if not torch.equal(outs["A"], outs["B"]):
            print(f"  note: {shape}: the copy's output differs from the built op's")
        med = hot_cold_ms({key: lambda r, f=f: f() for key, f in fns.items()}, rounds)
        mb = 2 * pool_k.numel() * 4 / 1e6
        print(f"| {shape} | {mb:.1f} | {hot_cold_cells(med)} | "
              f"{mb / med[('A', 'cold')]:.1f} |")


def shapes(spec: str) -> list[tuple[int, int]]:
    """``"32x128,8x64"`` as [(32, 128), (8, 64)]."""
    pairs = [v.split("x") for v in spec.split(",")]
    return [(int(b), int(c)) for b, c in pairs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, action="append", default=[])
    ap.add_argument("--pool-layouts", default="",
                    help="A,B: A's engine with a KV pool of layout A, B's of layout B (e.g. "
                         "head-major,token-major); the decode and prefill A/Bs only")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llama-bench",
                    help="the checkpoint of the decode and prefill A/Bs")
    ap.add_argument("--decode", default="32x128,32x1024", help="BxC list; empty: none")
    ap.add_argument("--prefill", default="",
                    help="prompt lengths, N or N/CHUNK, e.g. 512,1024/256; empty: none")
    ap.add_argument("--rounds", type=int, default=None,
                    help="A/B rounds of every section (default: 8 for decode and prefill, 30 "
                         "for the linears, 20 for attention)")
    ap.add_argument("--attention", default="1x512,32x128,32x1024",
                    help="BxC or BxC:H/KxD list for a ragged_attention copy; empty: none")
    ap.add_argument("--attention-layout", choices=("head-major", "token-major"),
                    default="head-major", help="the KV pools' layout in --attention")
    ap.add_argument("--linear-rows", default="1,16,32,256", help="empty: none")
    ap.add_argument("--cpu", type=int, default=0)
    args = ap.parse_args()
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be at least 1")
    layouts = tuple(args.pool_layouts.split(",")) if args.pool_layouts else None
    if layouts is not None and len(layouts) != 2:
        ap.error("--pool-layouts takes two layouts, A,B")
    if not args.source and layouts is None:
        ap.error("give a --source to A/B, or --pool-layouts")
    attention = ([AttentionShape.parse(v) for v in args.attention.split(",")]
                 if args.attention else [])  # a bad spec stops here, before the build
    torch.set_num_threads(1)
    pin(args.cpu)
    if not load_cpu_ops():
        raise SystemExit("the engine's C++ ops do not build here (see the WARNING above)")
    replaced = build_variant(args.source) if args.source else set()
    b_ops = (f"{sorted(replaced)} from {', '.join(map(str, args.source))}" if replaced
             else "the built ops")
    pools = (f"; A's KV pool {layouts[0]}, B's {layouts[1]}" if layouts
             else "; one engine, kv.layout auto")
    print(f"ISA {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, cpu "
          f"{args.cpu}, 1 thread, CPU time; {args.model.name}; A = the built ops, B = {b_ops}"
          f"{pools}\n")
    arms = make_arms(args.model, replaced, layouts)  # type: ignore[arg-type]
    if args.decode:
        ab_decode(shapes(args.decode), args.rounds or 8, arms)
        print()
    if args.prefill:
        ab_prefill(args.prefill.split(","), args.rounds or 8, arms)
        print()
    if args.attention and "ragged_attention.cpp" in replaced:
        ab_attention(attention, args.rounds or 20, args.attention_layout)
        print()
    if args.linear_rows and "linear_ops.cpp" in replaced:
        ab_linears([int(v) for v in args.linear_rows.split(",")], args.rounds or 30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
