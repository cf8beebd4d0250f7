"""llama.cpp as the peer of nanoqwen's CPU benchmarks: the checkpoint as GGUF files (converted with the installed
llama-cpp-python's own converter, then quantised by llama.cpp), the instruction sets its build uses, and decoding
several sequences together through its C API. bench_llamacpp.py's docstring says how to build llama-cpp-python;
nothing here is a test dependency."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402  (the repository's root)

ROOT = bench_model.ROOT
GGUF_DIR = ROOT / "bench" / ".models" / "gguf"
SRC_DIR = ROOT / "bench" / ".models" / "llama-cpp-src"
FORMATS = ("bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m")


def import_llama_cpp(fix: str = ""):
    """The llama_cpp module, or an exit that says how to build it (bench_llamacpp.py's docstring has the AVX2-only and
    no-AMX builds), then `fix`: what else the caller's user can do."""
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python "
                 "sentencepiece (15-25 minutes on 2 cores, once; bench/bench_llamacpp.py's docstring has other builds)"
                 + fix)
    return llama_cpp


def llama_instructions() -> list[str]:
    """The x86 instruction sets the installed llama.cpp was built to use (from llama_print_system_info),
    e.g. ["AVX2", "FMA", "F16C", "AVX512", ...]: a GGML_NATIVE build on an AVX-512 CPU uses AVX-512 even
    when nanoqwen is limited to AVX2, so the table names them."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    wanted = ("AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_INT8")
    flags = dict(part.split(" = ") for part in info.replace("CPU : ", "").split(" | ") if " = " in part)
    return [f for f in wanted if flags.get(f) == "1"]


def llama_source() -> Path:
    """The installed llama-cpp-python's vendored llama.cpp source (for its GGUF converter), fetched once."""
    import llama_cpp

    version = llama_cpp.__version__
    found = sorted(SRC_DIR.glob(f"llama_cpp_python-{version}/vendor/llama.cpp"))
    if found:
        return found[0]
    SRC_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                    str(SRC_DIR), f"llama-cpp-python=={version}"], check=True)
    with tarfile.open(next(SRC_DIR.glob(f"llama_cpp_python-{version}.tar.gz"))) as tar:
        tar.extractall(SRC_DIR, filter="data")
    return SRC_DIR / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def gguf_files(model_dir: Path, formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    """The checkpoint as GGUF files, bf16 converted from it and the other formats quantised from that (made once)."""
    import llama_cpp

    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    files = {fmt: GGUF_DIR / f"{model_dir.name}-{fmt}.gguf" for fmt in ("bf16", *formats)}
    if not files["bf16"].exists():
        src = llama_source()
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "bf16",
                        "--outfile", str(files["bf16"])], check=True, env=env)
    for fmt in formats:
        if fmt != "bf16" and not files[fmt].exists():
            ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt.upper()}")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = os.cpu_count() or 1
            if llama_cpp.llama_model_quantize(str(files["bf16"]).encode(), str(files[fmt]).encode(), params):
                sys.exit(f"llama_model_quantize to {fmt} failed")
    return files


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF file's tensors (what its weights take as the file holds them)."""
    from nanoqwen.model_loader.gguf_file import GGUFCheckpoint

    return GGUFCheckpoint(path).tensor_bytes()


class LlamaBatchDecode:
    """llama.cpp decoding several sequences together on one GGUF file, through llama-cpp-python's C API (its `Llama`
    class decodes one sequence). Called with B prompts of one length, it makes a context of B sequences (n_seq_max,
    each its own cache; flash attention on, all threads), passes the prompts in one llama_decode, then decodes one
    token a sequence a step, each the argmax of its logits (greedy, no end of sequence), and returns the seconds of
    `tokens` such steps (the first new token comes from the prompts' pass, as in nanoqwen's generate of 1 + tokens
    minus one of 1)."""

    def __init__(self, gguf: str, tokens: int) -> None:
        import llama_cpp

        self.llama_cpp, self.gguf, self.tokens = llama_cpp, gguf, tokens
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # (the logger of llama.cpp's log lines)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            sys.exit(f"llama.cpp could not load {gguf}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.ctx = self.tokens_in = None
        self.shape = (0, 0)  # (sequences, prompt length) the context was made for

    def _context(self, batch: int, prompt_len: int) -> None:
        lc = self.llama_cpp
        self._free_context()
        params = lc.llama_context_default_params()
        params.n_ctx = batch * (prompt_len + self.tokens + 8)
        params.n_batch = params.n_ubatch = max(512, batch * prompt_len)  # all prompts in one pass
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = os.cpu_count() or 1
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            sys.exit(f"llama.cpp could not make a context of {batch} sequences for {self.gguf}")
        self.tokens_in = lc.llama_batch_init(params.n_batch, 0, 1)
        self.shape = (batch, prompt_len)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries -> the argmax of each output."""
        import numpy as np

        b = self.tokens_in
        b.n_tokens = len(entries)
        for i, (token, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, out
            b.seq_id[i][0] = seq
        if self.llama_cpp.llama_decode(self.ctx, b) != 0:
            sys.exit(f"llama_decode failed on a batch of {len(entries)} tokens ({self.gguf})")
        outputs = sum(1 for *_, out in entries if out)
        logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits(self.ctx), shape=(outputs, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def __call__(self, prompts: list[list[int]]) -> float:
        n = len(prompts[0])
        if any(len(p) != n for p in prompts):
            raise ValueError("LlamaBatchDecode takes prompts of one length")
        if self.shape != (len(prompts), n):
            self._context(len(prompts), n)
        self.llama_cpp.llama_memory_clear(self.llama_cpp.llama_get_memory(self.ctx), True)
        last = self._decode([(t, i, s, i == n - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        start = time.perf_counter()
        for step in range(self.tokens):
            last = self._decode([(token, n + step, s, True) for s, token in enumerate(last)])
        return time.perf_counter() - start

    def _free_context(self) -> None:
        if self.ctx:
            self.llama_cpp.llama_batch_free(self.tokens_in)
            self.llama_cpp.llama_free(self.ctx)
            self.ctx = self.tokens_in = None

    def close(self) -> None:
        self._free_context()
        self.llama_cpp.llama_model_free(self.model)
