"""Which lossless codec for checkpoint chunks: ratio and single-core speed on real states.

Three kinds of data, each cut into the 1 MiB units unickpt compresses one by one:
- bf16 weights of a small GPT (the demo's model) trained ``--steps`` steps with AdamW;
- that run's fp32 AdamW moments (``exp_avg``, ``exp_avg_sq``);
- bf16 weights of the same model at initialization.

Codecs: ``zstandard`` on byte-grouped data (each element's bytes split into planes: exponent
bytes apart from mantissa bytes) at levels 1 to 3, ``zstandard`` level 1 on the plain bytes,
``blosc2`` (byte shuffle or bitshuffle, then zstd or lz4, one thread) and ``zipnn`` when they
import. Every codec runs in one thread, so the speeds are per core; every round trip is checked
bit for bit. Prints a Markdown table (docs/benchmarks.md, "Lossless compression")::

    python benchmarks/compression.py --steps 200

``--save-load DIR`` instead times ``unickpt.save`` (durable) and ``unickpt.load`` of the
benchmark's 100M state (``unickpt bench --params 100M``: fp32 GPT weights and AdamW moments after
one step, built in one process) into ``DIR``, with and without ``compress=True``, runs
alternating::

    python benchmarks/compression.py --save-load /tmp/unickpt-compress --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from unickpt.demo.model import GPT, GPTConfig
from unickpt.engine.compress import CODEC, decode_unit, encode_unit

UNIT = 1 << 20
Codec = tuple[Callable[[bytes, int], bytes], Callable[[bytes, int, int], bytes]]


def trained_state(steps: int, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Weights (bf16) and AdamW moments (fp32) of a small GPT after ``steps`` steps, and the
    weights (bf16) at initialization."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=256, context_len=64, n_layers=4, n_heads=4, d_model=256))
    init = [p.detach().to(torch.bfloat16).clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    text = torch.randint(0, 256, (1 << 16,))
    text = (text % 64) + (torch.arange(len(text)) % 7) * 16 % 256  # some structure to learn
    for _ in range(steps):
        at = torch.randint(0, len(text) - 65, (16,))
        batch = torch.stack([text[a : a + 65] for a in at.tolist()])
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = [p.detach().to(torch.bfloat16) for p in model.parameters()]
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return {
        "bf16 weights, trained": weights,
        "fp32 Adam moments": moments,
        "bf16 weights, init": init,
    }


def units(tensors: list[torch.Tensor]) -> tuple[list[bytes], int]:
    raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    return [raw[i : i + UNIT] for i in range(0, len(raw), UNIT)], tensors[0].element_size()


def _zstd_grouped(level: int) -> Codec:
    return (
        lambda raw, size: encode_unit(raw, size, level),
        lambda data, n, size: decode_unit(data, n, size).tobytes(),
    )


def _zstd_plain() -> Codec:
    import zstandard

    c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    return (lambda raw, size: c.compress(raw), lambda data, n, size: d.decompress(data, n))


def _blosc2(filter_name: str, codec_name: str) -> Codec:
    import blosc2

    filt = getattr(blosc2.Filter, filter_name)
    codec = getattr(blosc2.Codec, codec_name)
    blosc2.set_nthreads(1)

    def enc(raw: bytes, size: int) -> bytes:
        out: bytes = blosc2.compress2(
            raw, typesize=size, clevel=1, filter=filt, codec=codec, nthreads=1
        )
        return out

    def dec(data: bytes, n: int, size: int) -> bytes:
        out: bytes = blosc2.decompress2(data)
        return out

    return enc, dec


def _zipnn(dtype: str) -> Codec:
    from zipnn import ZipNN  # type: ignore[import-not-found]

    z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    return (
        lambda raw, size: bytes(z.compress(raw)),
        lambda data, n, size: bytes(z.decompress(data)),
    )


@dataclass(frozen=True)
class Row:
    data: str
    codec: str
    ratio: float
    compress_gbs: float
    decompress_gbs: float
    exact: bool


def measure(name: str, codec: Codec, data: str, pieces: list[bytes], size: int) -> Row:
    enc, dec = codec
    t0 = time.perf_counter()
    packed = [enc(p, size) for p in pieces]
    t1 = time.perf_counter()
    back = [dec(q, len(p), size) for q, p in zip(packed, pieces)]
    t2 = time.perf_counter()
    exact = all(b == p for b, p in zip(back, pieces))
    total = sum(map(len, pieces))
    stored = sum(min(len(q), len(p)) for q, p in zip(packed, pieces))  # raw when larger
    speeds = total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9
    return Row(data, name, stored / total, *speeds, exact)


def codecs(size_dtype: str) -> dict[str, Codec]:
    found: dict[str, Codec] = {f"{CODEC} level {k}": _zstd_grouped(k) for k in (1, 2, 3)}
    found["zstd level 1, plain bytes"] = _zstd_plain()
    try:
        found["blosc2 shuffle + zstd 1"] = _blosc2("SHUFFLE", "ZSTD")
        found["blosc2 bitshuffle + zstd 1"] = _blosc2("BITSHUFFLE", "ZSTD")
        found["blosc2 shuffle + lz4 1"] = _blosc2("SHUFFLE", "LZ4")
    except ImportError:
        pass
    with contextlib.suppress(ImportError):
        found["zipnn"] = _zipnn(size_dtype)
    return found


def bench_state(params: int) -> dict[str, object]:
    """The benchmark's training state in one process: its GPT (fp32, values N(0, 0.02) as
    ``unickpt.bench.model`` fills them) and AdamW after one step with its gradients."""
    from unickpt.bench.model import GPT as BenchGPT
    from unickpt.bench.model import config_for_params

    model = BenchGPT(config_for_params(params))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).mul_(0.02))
            p.grad = p.detach() * 0.5 + 0.01
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": opt}


def save_load(folder: str, params: int, repeats: int) -> None:
    import unickpt

    state = bench_state(params)
    times: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for _ in range(repeats):
        for compress in (False, True):
            path = f"{folder}/{'compressed' if compress else 'plain'}"
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            report = unickpt.save(path, state, compress=compress)
            t1 = time.perf_counter()
            unickpt.load(path, state)
            t2 = time.perf_counter()
            times[compress].append((t1 - t0, t2 - t1, report.bytes_written))
    print("| compress | save, durable (s) | load (s) | written (MB) |")
    print("| --- | --- | --- | --- |")
    for compress, runs in times.items():
        save_s, load_s, written = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"| {compress} | {save_s:.2f} | {load_s:.2f} | {written / 1e6:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-load", metavar="DIR", default=None)
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.save_load is not None:
        save_load(args.save_load, args.params, args.repeats)
        return
    torch.set_num_threads(1)
    rows = []
    for data, tensors in trained_state(args.steps).items():
        pieces, size = units(tensors)
        dtype = "bfloat16" if size == 2 else "float32"
        for name, codec in codecs(dtype).items():
            rows.append(measure(name, codec, data, pieces, size))
    print("| data | codec | stored / raw | compress GB/s | decompress GB/s | bit-exact |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r.data} | {r.codec} | {r.ratio:.3f} | {r.compress_gbs:.2f} | "
            f"{r.decompress_gbs:.2f} | {'yes' if r.exact else 'no'} |"
        )


if __name__ == "__main__":
    main()
