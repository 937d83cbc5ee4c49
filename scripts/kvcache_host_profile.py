"""Usage: python scripts/kvcache_host_profile.py [--emulate] [SK]   (torch and cubeattn installed)

Host microseconds per call of flash_attn_with_kvcache beside flash_attn_func, at a decode step:
B=8, one query, heads 32/8, head_dim 128, bf16, SK keys per cache row (default 4096; 1024 with
--emulate). Each line: the best of 7 loops' mean host time per call (no sync: on a GPU the
kernels run behind), and on a GPU the wall time per call over the loop with one sync at its end.

On a CUDA machine it runs torch CUDA tensors. With --emulate, on a machine without a GPU: torch
CPU tensors that say is_cuda=True, torch's raw stream read as 0, and the stub CUDA driver
(scripts/stub_cuda, built into target/stub_cuda here) under the real Rust backend, so every
Python and Rust host step of the device-resident call runs (spec, workspace, plan lookup and
build, launch arguments); the driver's own calls and torch's CUDA allocator cost nothing there,
and torch.empty of the workspace is a host allocation.
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMULATE = "--emulate" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--emulate"]

if EMULATE and os.environ.get("_KVCACHE_PROFILE_STUB") != "1":
    stub = os.path.join(ROOT, "target", "stub_cuda")
    os.makedirs(os.path.join(stub, "include"), exist_ok=True)
    for name, so in (("libcuda_stub.c", "libcuda.so"), ("libnvrtc_stub.c", "libnvrtc.so")):
        subprocess.check_call(["cc", "-shared", "-fPIC", "-O1", "-o", os.path.join(stub, so),
                               os.path.join(ROOT, "scripts", "stub_cuda", name)])
    for link, to in (("libcuda.so.1", "libcuda.so"), ("libnvrtc.so.13", "libnvrtc.so")):
        if not os.path.lexists(os.path.join(stub, link)):
            os.symlink(to, os.path.join(stub, link))
    open(os.path.join(stub, "include", "cuda_fp16.h"), "a").close()
    env = dict(os.environ, LD_LIBRARY_PATH=stub, CUDA_PATH=stub, CUBEATTN_CACHE_DIR="off", OMP_NUM_THREADS="1",
               _KVCACHE_PROFILE_STUB="1")
    sys.exit(subprocess.call([sys.executable] + sys.argv, env=env))

import torch  # noqa: E402

if EMULATE:
    torch.set_num_threads(1)
    torch.Tensor.is_cuda = property(lambda self: True)
import cubeattn  # noqa: E402

if EMULATE:
    cubeattn._raw_stream = lambda torch, gpu: 0
    dev = "cpu"
else:
    dev = "cuda"
print(cubeattn.backend_status()["reason"] or "cuda", flush=True)

B, SQ, HQ, HKV, D = 8, 1, 32, 8, 128
SK = int(ARGS[0]) if ARGS else (1024 if EMULATE else 4096)
g = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev)


q, kc, vc = rand(B, SQ, HQ, D), rand(B, SK, HKV, D), rand(B, SK, HKV, D)
kn, vn = rand(B, 1, HKV, D), rand(B, 1, HKV, D)
seq_t = torch.full((B,), SK - 9, dtype=torch.int32, device=dev)
ragged = torch.tensor([SK - 9 - 3 * i for i in range(B)], dtype=torch.int32, device=dev)
step = [0]


def growing():  # a decode loop: the key count grows by one each call (a new spec and plan each time)
    step[0] = (step[0] + 1) % (SK - 16)
    return cubeattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=8 + step[0])


CASES = {
    "flash_attn_func (dense)": lambda: cubeattn.flash_attn_func(q, kc, vc),
    "kvcache cache_seqlens=int": lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=SK - 9),
    "kvcache cache_seqlens=int32 tensor": lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq_t),
    "kvcache int, return_softmax_lse": lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=SK - 9,
                                                                                return_softmax_lse=True),
    "kvcache int + append k, v": lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=SK - 9),
    "kvcache ragged tensor + append k, v": lambda: cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn,
                                                                                    cache_seqlens=ragged),
    "kvcache int growing each call": growing,
}


def sync():
    if not EMULATE:
        torch.cuda.synchronize()


for name, f in CASES.items():
    n = 500 if "growing" in name else 2000
    for _ in range(100):
        f()
    assert cubeattn.last_backend() == "cuda", cubeattn.last_backend()
    sync()
    host, wall = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) / n * 1e6)
        wall.append((t2 - t0) / n * 1e6)
    line = f"{name:40s} host {min(host):7.1f} us/call"
    if not EMULATE:
        line += f"   wall {min(wall):7.1f} us/call"
    print(line, flush=True)
