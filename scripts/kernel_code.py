#!/usr/bin/env python3
"""The generated kernel code, without a GPU. DIR holds the CUDA source CubeCL generates, written by
the `dump_tensor_core_kernels` test (src/backend/cuda/kernel_dump.rs).

    python3 scripts/kernel_code.py count DIR [--sass]
        compiles each source with NVRTC and the options cubeattn uses, dumps the SASS with cuobjdump
        and prints per kernel the registers and, for its largest loops (backward branches), the
        instruction count and mix: the largest loop is the main key-tile / row-tile loop.
        Needs CUDA_PATH with lib/libnvrtc.so*, bin/cuobjdump and include/ (the NVIDIA CUDA 13
        wheels from PyPI have them).
    python3 scripts/kernel_code.py same DIR_A DIR_B
        whether two dumps are the same code: CubeCL emits struct definitions, mutable variable
        declarations and the shared-memory layout in hash order (they differ run to run), so
        those are compared as sets, local names are renumbered by first use, and everything
        else is compared line by line. Exit 1 if any differs.
        A refactor of the #[cube] code that keeps every kernel "same" cannot change its results.
    python3 scripts/kernel_code.py same-ptx DIR_A DIR_B
        for the kernels `same` finds different, whether NVRTC makes the same PTX of both (sm_90a,
        cubeattn's options): a source that differs only in what the compiler folds (a loop index
        CubeCL leaves as `uint32(0) * uint32(32)`, say) compiles to the same code. Needs CUDA_PATH
        with lib/libnvrtc.so* and include/. Exit 1 if any PTX differs.
"""
import collections
import ctypes
import glob
import os
import re
import subprocess
import sys

CUDA = os.environ.get("CUDA_PATH", "/usr/local/cuda")


def nvrtc():
    for cand in sorted(glob.glob(os.path.join(CUDA, "lib*", "libnvrtc.so*"))):
        if "builtins" not in cand and "alt" not in cand:
            return ctypes.CDLL(cand)
    raise SystemExit(f"no libnvrtc under {CUDA}")


def options(arch):
    inc = os.path.join(CUDA, "include")
    return [f"--gpu-architecture={arch}", f"--include-path={inc}", f"--include-path={inc}/cccl", "-ftz=true"]


def compile_ptx(lib, path, arch="compute_90a"):
    """The PTX NVRTC makes of one source (None if it does not compile)."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), open(path).read().encode(), b"k.cu", 0, None, None) == 0
    opts = options(arch)
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    if lib.nvrtcCompileProgram(prog, len(opts), arr):
        return None
    n = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, buf)
    return buf.value


def compile_cubin(lib, path, arch="sm_90a"):
    src = open(path).read()
    opts = options(arch)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    if lib.nvrtcCompileProgram(prog, len(opts), arr):
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise SystemExit(f"{path}: NVRTC failed\n{log.value.decode()[-3000:]}")
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    # ptxas warnings (C7515: serialised wgmma; C7508: setmaxnreg dropped) are the ones that matter
    for line in log.value.decode(errors="replace").splitlines():
        if "warning" in line.lower():
            print(f"   {os.path.basename(path)}: {line.strip()}")
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    out = path[:-3] + ".cubin"
    open(out, "wb").write(buf.raw)
    return out


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass(cubin):
    dump = subprocess.run([os.path.join(CUDA, "bin", "cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([os.path.join(CUDA, "bin", "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    ins = []
    for m in LINE.finditer(dump):
        ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return dump, ins, res


def loops(ins):
    """(start, end) address ranges of backward branches."""
    out = []
    for addr, op, args in ins:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", args)
            if t and int(t.group(1), 16) <= addr:
                out.append((int(t.group(1), 16), addr))
    return out


def mix(ins, lo, hi):
    c = collections.Counter(op.split(".")[0] for a, op, _ in ins if lo <= a <= hi)
    return sum(c.values()), c


def canon(path):
    """The source with the hash-ordered parts (struct definitions, `T l_mut_N;` declarations,
    shared-memory placement) taken out and sorted."""
    lines = open(path).read().split("\n")
    body, structs, decls = [], [], []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("struct __align__"):
            j = i
            while not lines[j].startswith("};"):
                j += 1
            structs.append("\n".join(lines[i:j + 1]))
            i = j + 1
            continue
        if "dynamic_shared_mem[" in line or "// Shared array size" in line or line.startswith("// entry"):
            pass
        elif re.match(r"^[\w:<>]+ l_mut_\d+;$", line.strip()):
            decls.append(line.strip())
        else:
            body.append(line)
        i += 1
    # Local names are numbered by CubeCL in creation order: an edit that creates one value more or
    # less earlier (a comptime branch removed, say) renumbers everything after it. Renumber by
    # first use in the body, so only the code itself is compared.
    names = {}

    def rename(m):
        return names.setdefault(m.group(0), f"{m.group(1)}#{len(names)}")

    ident = re.compile(r"\b(l_mut_|l_arr_|l_)\d+\b")
    body = [ident.sub(rename, line) for line in body]
    decls = [ident.sub(rename, line) for line in decls]
    return "\n".join(sorted(structs) + sorted(decls) + body)


def same(a, b):
    bad = 0
    for path in sorted(glob.glob(os.path.join(a, "*.cu"))):
        other = os.path.join(b, os.path.basename(path))
        ok = os.path.exists(other) and canon(path) == canon(other)
        bad += not ok
        print(("same " if ok else "DIFF ") + os.path.basename(path))
    return 1 if bad else 0


def same_ptx(a, b):
    lib = nvrtc()
    bad = 0
    for path in sorted(glob.glob(os.path.join(a, "*.cu"))):
        other = os.path.join(b, os.path.basename(path))
        if os.path.exists(other) and canon(path) == canon(other):
            continue
        pa = compile_ptx(lib, path)
        ok = pa is not None and os.path.exists(other) and pa == compile_ptx(lib, other)
        bad += not ok
        print(("same ptx " if ok else "DIFF ptx ") + os.path.basename(path))
    return 1 if bad else 0


def count(d):
    lib = nvrtc()
    for path in sorted(glob.glob(os.path.join(d, "*.cu"))):
        cubin = compile_cubin(lib, path)
        dump, ins, res = sass(cubin)
        if "--sass" in sys.argv:
            open(path[:-3] + ".sass", "w").write(dump)
        regs = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        lmem = re.search(r"LOCAL:(\d+)", res)
        print(f"== {os.path.basename(path)}: {len(ins)} instructions, REG {regs and regs.group(1)}, "
              f"STACK {stack and stack.group(1)}, LOCAL {lmem and lmem.group(1)}")
        big = sorted(loops(ins), key=lambda r: r[0] - r[1])[:3]
        for lo, hi in big:
            n, c = mix(ins, lo, hi)
            keys = ["HMMA", "HGMMA", "WARPGROUP", "LDSM", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "SHFL", "LDGSTS", "LDS", "STS",
                    "LDL", "STL", "IMAD", "IADD3", "LEA", "VIADD", "ISETP", "SEL", "FSEL", "MOV", "BAR", "SYNCS"]
            other = n - sum(c[k] for k in keys)
            print(f"   loop {lo:#x}-{hi:#x}: {n} instr | " + " ".join(f"{k} {c[k]}" for k in keys if c[k]) + f" | other {other}")


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "same":
        sys.exit(same(sys.argv[2], sys.argv[3]))
    if len(sys.argv) >= 4 and sys.argv[1] == "same-ptx":
        sys.exit(same_ptx(sys.argv[2], sys.argv[3]))
    if len(sys.argv) >= 3 and sys.argv[1] == "count":
        count(sys.argv[2])
    else:
        sys.exit(__doc__)
