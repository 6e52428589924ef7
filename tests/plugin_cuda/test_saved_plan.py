"""The CUDA plugin's saved contexts without a GPU (ABI v7): the plan format (plan/saved.py) round-trips
and refuses damage with PlanBlobError; the NVRTC binary cache (device/nvrtc.py) and the algorithm
choices (device/algo_cache.py) through stand-ins for CuPy and NVRTC; the context check of
compute.subgraph_from_context; the factory's compatibility answers."""

from __future__ import annotations

import hashlib
import json
import types

import numpy as np
import pytest

import abi
from abi import fused_blob, sdk
from abi.sdk import PluginError
from plugin_cuda.device import algo_cache, nvrtc
from plugin_cuda.plan import compute, saved
from tests.abi.test_fused_blob import _same_value, sample

MODULES = [saved.SavedModule("sm_90", "a" * 64, b"\x7fELF cubin one"),
           saved.SavedModule("compute_90", "b" * 64, b".version 8.0\n ptx\0")]
ALGOS = {"cublaslt|cc90|8x16x32|bias|68": "00ff" * 32, "cudnn|cc90|forward|x[1]": [1, 0]}


def _plan() -> saved.SavedPlan:
    return saved.SavedPlan(fused_blob.to_bytes(sample()), cc="90", modules=list(MODULES), algos=dict(ALGOS))


def test_round_trip_keeps_every_section():
    back = saved.unpack(saved.pack(_plan()))
    assert (back.cc, back.format, back.algos, back.modules) == ("90", saved.FORMAT, ALGOS, MODULES)
    assert back.graph == fused_blob.to_bytes(sample())
    fused = back.fused_graph()
    assert fused.name == "EP_fused_0" and [n.name for n in fused.graph.nodes] == ["mul0", "cast1"]


def test_a_bare_fused_graph_reads_as_format_1_with_no_modules():
    back = saved.unpack(fused_blob.to_bytes(sample()))
    assert (back.format, back.cc, back.modules, back.algos) == (1, "", [], {})
    assert back.fused_graph().graph.name == "g"


def _head(blob: bytes) -> tuple[dict, bytes]:
    start = len(saved.MAGIC) + 12
    size = int.from_bytes(blob[len(saved.MAGIC) + 4:start], "little")
    return json.loads(blob[start:start + size]), blob[start + size:]


def _repack(blob: bytes, edit) -> bytes:
    """`blob` with its header edited by `edit(head)` (the sections left as they are)."""
    head, payload = _head(blob)
    edit(head)
    text = json.dumps(head).encode()
    return saved.MAGIC + saved.FORMAT.to_bytes(4, "little") + len(text).to_bytes(8, "little") + text + payload


def _flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0xFF]) + blob[at + 1:]


DAMAGE = [
    (lambda b: b"garbage" * 9, r"^not a CUDA plan context \(63 bytes\): no EPHOST-CUDA-PLAN header \(allowed: plan "
                               r"format 4, or a bare fused graph\)$"),
    (lambda b: b[:20], r"^truncated CUDA plan context: 20 bytes, the fixed header needs 29$"),
    (lambda b: b[:40], r"^truncated CUDA plan context: the header needs \d+ bytes, 11 follow$"),
    (lambda b: b[:len(saved.MAGIC)] + (2).to_bytes(4, "little") + b[len(saved.MAGIC) + 4:],
     r"^CUDA plan context format 2; this plugin reads format 4 \(and bare fused graphs\)$"),
    (lambda b: b[:-5], r"^truncated CUDA plan context: section 'module' needs bytes \d+\.\.\d+, \d+ follow the header$"),
    (lambda b: _flip(b, len(b) - 3), r"^damaged CUDA plan context: section 'module' \(18 bytes\) does not match its "
                                     r"CRC-32$"),
    (lambda b: _flip(b, len(b) - 300), r"^damaged CUDA plan context: section 'graph' \(\d+ bytes\) does not match "
                                       r"its CRC-32$"),
    (lambda b: _repack(b, lambda h: h.update(format=1)),
     r"^CUDA plan context header says format 1; expected 4$"),
    (lambda b: _repack(b, lambda h: h["sections"][1].update(name="ptxas")),
     r"^CUDA plan context section 'ptxas'; allowed: 'graph', 'module', 'array', 'cupy'$"),
    (lambda b: _repack(b, lambda h: h["sections"][1].update(name="graph")),
     r"^CUDA plan context has 2 graph sections; expected 1$"),
    (lambda b: _repack(b, lambda h: h.pop("algos")), r"^unreadable CUDA plan context header: KeyError: 'algos'$"),
    (lambda b: b[:len(saved.MAGIC) + 12] + b"{not json" + b[len(saved.MAGIC) + 21:],
     r"^unreadable CUDA plan context header: JSONDecodeError: "),
]


@pytest.mark.parametrize(("damage", "pattern"), DAMAGE, ids=[f"damage{i}" for i in range(len(DAMAGE))])
def test_damaged_contexts_are_refused(damage, pattern):
    with pytest.raises(saved.PlanBlobError, match=pattern):
        saved.unpack(damage(saved.pack(_plan())))


def test_a_graph_section_that_does_not_read_is_a_plan_blob_error():
    plan = saved.unpack(saved.pack(saved.SavedPlan(b"EPHOST-FUSED-GRAPH\0" + b"\x01" * 3, cc="90")))
    with pytest.raises(saved.PlanBlobError, match=r"^graph section: truncated fused graph: "):
        plan.fused_graph()


# -- plan format 3: the constants as array sections, loaded as views of the context ----------------------------

def _with_constants(modules=()) -> bytes:
    """A context with sample()'s constant as an array section: the last section unless `modules`."""
    return saved.pack(saved.SavedPlan.of(sample(), cc="90", modules=list(modules), algos=dict(ALGOS)))


def test_constants_round_trip_as_aligned_read_only_views_of_the_context():
    blob = _with_constants(MODULES)
    head, payload = _head(blob)
    arrays = [s for s in head["sections"] if s["name"] == "array"]
    assert [(s["value"], s["dtype"], s["shape"], s["size"]) for s in arrays] == [(1, "<f4", [2, 3], 24)]
    base = len(blob) - len(payload)
    assert all((base + s["offset"]) % saved.ALIGN == 0 for s in head["sections"]), head["sections"]
    back = saved.unpack(blob)
    assert (back.cc, back.format, back.algos, back.modules) == ("90", saved.FORMAT, ALGOS, MODULES)
    w = back.constants[1]
    assert not w.flags.writeable and np.shares_memory(w, np.frombuffer(blob, np.uint8)), "a copy, not a view"
    assert fused_blob.from_bytes(back.graph).graph.values[1].constant is None  # not in the graph section twice
    fused = back.fused_graph()
    for a, b in zip(sample().graph.values, fused.graph.values, strict=True):
        _same_value(a, b)
    np.testing.assert_array_equal(fused.graph.nodes[0].attrs["value"], np.array([[1, 2]], np.int64))  # attrs stay


def _edit_array(edit) -> bytes:
    return _repack(_with_constants(), lambda h: edit(next(s for s in h["sections"] if s["name"] == "array")))


ARRAY_DAMAGE = [
    (lambda: _with_constants()[:-5], r"^truncated CUDA plan context: section 'array' needs bytes \d+\.\.\d+, \d+ follow "
                                     r"the header$"),
    (lambda: _flip(_with_constants(), len(_with_constants()) - 3),
     r"^damaged CUDA plan context: section 'array' \(24 bytes\) does not match its CRC-32$"),
    (lambda: _edit_array(lambda s: s.update(dtype="<f8")),
     r"^CUDA plan context array for value 1: 24 bytes do not hold a float64 array of shape \[2, 3\]$"),
    (lambda: _edit_array(lambda s: s.update(dtype="|O")),
     r"^CUDA plan context array for value 1: 24 bytes do not hold a object array of shape \[2, 3\]$"),
    (lambda: _edit_array(lambda s: s.update(shape=[2, -3])),
     r"^CUDA plan context array for value 1: 24 bytes do not hold a float32 array of shape \[2, -3\]$"),
    (lambda: _edit_array(lambda s: s.pop("dtype")), r"^unreadable CUDA plan context header: KeyError: 'dtype'$"),
    (lambda: _repack(_with_constants(), lambda h: h["sections"].append(h["sections"][-1])),
     r"^CUDA plan context has two array sections for value 1$"),
]


@pytest.mark.parametrize(("make", "pattern"), ARRAY_DAMAGE, ids=[f"array{i}" for i in range(len(ARRAY_DAMAGE))])
def test_damaged_array_sections_are_refused(make, pattern):
    with pytest.raises(saved.PlanBlobError, match=pattern):
        saved.unpack(make())


@pytest.mark.parametrize(("edit", "pattern"), [
    (lambda s: s.update(value=0), r"^CUDA plan context array for value 0: the graph has 4 values; expected the "
                                  r"index of an initializer without a constant$"),  # the graph's input
    (lambda s: s.update(value=9), r"^CUDA plan context array for value 9: the graph has 4 values; expected the "
                                  r"index of an initializer without a constant$"),
])
def test_an_array_that_does_not_fit_its_value_is_refused(edit, pattern):
    plan = saved.unpack(_edit_array(edit))  # the bytes read; the graph says they do not belong there
    with pytest.raises(saved.PlanBlobError, match=pattern):
        plan.fused_graph()


# -- the context check of CudaEp.compile_from_context --------------------------------------------------------

def _stand_in_ep(cc: str):
    factory = types.SimpleNamespace(compute_capability=lambda device_id: cc)
    return types.SimpleNamespace(factory=factory, device_id=0)


def test_a_context_installs_its_modules_and_choices(monkeypatch):
    monkeypatch.setattr(nvrtc, "_provided", {})
    monkeypatch.setattr(algo_cache, "_choices", {})
    monkeypatch.setattr(algo_cache, "_state", {"versions": "", "loaded": True})
    graph = compute.subgraph_from_context(_stand_in_ep("90"), "CUDA_fused_0", saved.pack(_plan()))
    assert [n.name for n in graph.nodes] == ["mul0", "cast1"]
    assert nvrtc._provided == {(m.arch, m.digest): m.binary for m in MODULES}
    assert algo_cache.lookup("cudnn|cc90|forward|x[1]") == [1, 0]


@pytest.mark.parametrize(("blob", "pattern"), [
    (saved.pack(_plan()), r"^context of fused node 'CUDA_fused_0' was compiled for compute capability 90; device 0 "
                          r"has 80$"),
    (saved.pack(_plan())[:-5], r"^context of fused node 'CUDA_fused_0': truncated CUDA plan context: "),
], ids=["another-compute-capability", "truncated"])
def test_a_context_of_another_device_or_damaged_is_refused(monkeypatch, blob, pattern):
    monkeypatch.setattr(nvrtc, "_provided", {})
    with pytest.raises(PluginError, match=pattern) as info:
        compute.subgraph_from_context(_stand_in_ep("80"), "CUDA_fused_0", blob)
    assert info.value.code == abi.EP_INVALID_GRAPH  # the host then compiles the kept subgraph
    assert nvrtc._provided == {}  # nothing of a refused context is installed


# -- the factory's compatibility answers -------------------------------------------------------------------

def _factory():
    from plugin_cuda.plugin import EP_NAME, CudaFactory

    f = object.__new__(CudaFactory)
    f.runtime = types.SimpleNamespace(compiled_version=7)
    f.compute_capability = lambda device_id: "90"
    f.cuda_versions = lambda: "14.0.0/12080"
    return f, EP_NAME


@pytest.mark.parametrize(("change", "answer"), [
    ({}, sdk.COMPILED_MODEL_SUPPORTED_OPTIMAL),
    ({"cc": "80"}, sdk.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION),
    ({"format": "1"}, sdk.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION),  # a bare-graph context of before
    ({"plugin": "0.0.9"}, sdk.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION),
    ({"cuda": "13.0.0/12080"}, sdk.COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION),
])
def test_compatibility_answers(change, answer):
    f, name = _factory()
    fields = {"plugin": f.plugin_version, "abi": 7, "format": saved.FORMAT, "cc": "90", "cuda": "14.0.0/12080"}
    fields.update(change)
    device = sdk.DeviceSpec(abi.DEVICE_GPU, 0, 0x10DE, "H100", "Cuda")
    assert f.validate_compatibility([device], sdk.compatibility_string(name, **fields)) == answer
    assert f.validate_compatibility([device], "OtherEP;format=2") == sdk.COMPILED_MODEL_UNSUPPORTED


# -- NVRTC's binary cache, through stand-ins for CuPy and the NVRTC binding ------------------------------------

class _FakeNvrtc:
    """The cupy_backends NVRTC binding's calls that nvrtc.load makes; `refuse`: sources that fail."""

    def __init__(self):
        self.compiled: list[tuple[str, tuple]] = []
        self.refuse = False

    def getVersion(self):
        return (12, 8)

    def getSupportedArchs(self):
        return (75, 80, 86, 89, 90)

    def createProgram(self, source, name, headers, include_names):
        self._source = source
        return 1

    def compileProgram(self, prog, options):
        if self.refuse:
            raise RuntimeError("NVRTC_ERROR_COMPILATION")
        self.compiled.append((self._source, tuple(options)))

    def getCUBIN(self, prog):
        return b"cubin:" + hashlib.sha256(self._source.encode()).hexdigest().encode()

    def getPTX(self, prog):
        return b"ptx:" + self._source.encode()

    def destroyProgram(self, prog):
        pass


class _FakeModule:
    """cupy.cuda.function.Module: the driver refuses a binary that starts with b"damaged"."""

    def load(self, binary):
        if binary.startswith(b"damaged"):
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
        self.binary = binary

    def get_function(self, name):
        return types.SimpleNamespace(ptr=id(self))


def _fake_cupy(cc: int):
    """CuPy's Device (a context manager with compute_capability) and function.Module, nothing else."""

    class Device:
        compute_capability = str(cc)

        def __init__(self, device_id=0):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device,
                                                            function=types.SimpleNamespace(Module=_FakeModule)))


@pytest.fixture
def fake_nvrtc(monkeypatch, tmp_path):
    fake = _FakeNvrtc()
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvrtc, "_binding", lambda: fake)
    monkeypatch.setattr(nvrtc, "_modules", {})
    monkeypatch.setattr(nvrtc, "_provided", {})
    monkeypatch.setattr(nvrtc, "stats", dict.fromkeys(nvrtc.stats, 0))
    nvrtc._supported_archs.cache_clear()
    yield fake
    nvrtc._supported_archs.cache_clear()


def test_binaries_come_from_the_process_then_provided_then_disk_then_nvrtc(fake_nvrtc, tmp_path):
    cp = _fake_cupy(90)
    first = nvrtc.load(cp, "src A", 0)
    assert (first.arch, first.digest) == ("sm_90", nvrtc.source_hash("src A"))
    assert fake_nvrtc.compiled == [("src A", ("--std=c++17", "--gpu-architecture=sm_90"))]
    path = tmp_path / "nvrtc" / "sm_90-nvrtc12-8" / f"{first.digest}.bin"
    assert path.read_bytes() == first.binary  # keyed by architecture, NVRTC version and source + options
    assert nvrtc.load(cp, "src A", 0) is first and nvrtc.stats["hits"] == 1
    nvrtc.clear()  # a new process: the disk serves it
    again = nvrtc.load(cp, "src A", 0)
    assert again.binary == first.binary and nvrtc.stats["disk"] == 1 and len(fake_nvrtc.compiled) == 1
    nvrtc.clear()
    nvrtc.provide("sm_90", nvrtc.source_hash("src B"), b"saved cubin of B")
    assert nvrtc.load(cp, "src B", 0).binary == b"saved cubin of B" and nvrtc.stats["provided"] == 1
    assert len(fake_nvrtc.compiled) == 1 and nvrtc.stats["compiles"] == 1


def test_a_damaged_binary_is_compiled_again(fake_nvrtc):
    cp = _fake_cupy(90)
    nvrtc.provide("sm_90", nvrtc.source_hash("src C"), b"damaged cubin")
    mod = nvrtc.load(cp, "src C", 0)
    assert mod.binary.startswith(b"cubin:") and nvrtc.stats["compiles"] == 1 and nvrtc.stats["provided"] == 0


def test_an_unknown_architecture_gets_ptx_of_the_newest_known(fake_nvrtc):
    mod = nvrtc.load(_fake_cupy(120), "src D", 0)
    assert mod.arch == "compute_90" and mod.binary == b"ptx:src D\0"
    assert fake_nvrtc.compiled[-1][1][-1] == "--gpu-architecture=compute_90"


def test_a_refused_source_goes_to_cupy_which_reports_the_log(fake_nvrtc, monkeypatch):
    fake_nvrtc.refuse = True

    class CompileException(Exception):
        pass

    def raw_module(code, options):
        raise CompileException("kern.cu(3): error: identifier 'x' is undefined")

    cp = _fake_cupy(90)
    cp.RawModule = raw_module
    with pytest.raises(nvrtc.CompileError, match=r"^kern.cu\(3\): error: identifier 'x' is undefined$"):
        nvrtc.load(cp, "broken", 0)


# -- algorithm choices ------------------------------------------------------------------------------------

@pytest.fixture
def algos(monkeypatch, tmp_path):
    monkeypatch.setenv("EPHOST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(algo_cache, "_choices", {})
    monkeypatch.setattr(algo_cache, "_order", [])
    monkeypatch.setattr(algo_cache, "_state", {"versions": "", "loaded": False})
    algo_cache.set_versions("14.0.0/12080")
    return tmp_path


def test_choices_persist_per_library_versions(algos):
    key = algo_cache.lt_key("90", 8, 16, 32, "bias", 68, 0)
    assert algo_cache.lookup(key) is None
    start = algo_cache.mark()
    algo_cache.record(key, "ab" * 64)
    assert algo_cache.taken(start) == {key: "ab" * 64}
    algo_cache.clear()  # a new process with the same libraries reads the file
    assert algo_cache.lookup(key) == "ab" * 64
    assert json.loads((algos / "algos" / "14.0.0_12080.json").read_text()) == {key: "ab" * 64}
    algo_cache.clear()
    algo_cache.set_versions("15.0.0/13000")  # other libraries: another file, nothing remembered
    assert algo_cache.lookup(key) is None


def test_a_damaged_choice_file_means_searching_again(algos):
    (algos / "algos").mkdir()
    (algos / "algos" / "14.0.0_12080.json").write_text("{\"cut")
    assert algo_cache.lookup(algo_cache.lt_key("90", 1, 1, 1, "bias", 68, 0)) is None


def test_lt_keys_name_the_data_type():
    assert algo_cache.lt_key("90", 8, 16, 32, "bias", 68, 0) != algo_cache.lt_key("90", 8, 16, 32, "bias", 68, 2)


def test_lt_keys_name_the_weight_layout():
    assert algo_cache.lt_key("90", 8, 16, 32, "bias", 77, 0, 32 << 20, True) != \
        algo_cache.lt_key("90", 8, 16, 32, "bias", 77, 0, 32 << 20)


def test_lt_keys_name_the_workspace_an_algorithm_was_chosen_for():
    # an algorithm found for 32 MiB may need some of it: never reused where the call gets none
    assert algo_cache.lt_key("90", 8, 16, 32, "bias", 68, 0) != algo_cache.lt_key("90", 8, 16, 32, "bias", 68, 0, 32 << 20)
    assert algo_cache.lt_key("90", 8, 16, 32, "bias", 68, 0, 0) == algo_cache.lt_key("90", 8, 16, 32, "bias", 68, 0)


def test_keys_of_symbolic_sizes_are_their_values():
    """A symbolic plan's GEMM sizes are SymInts printing as C expressions ("S0*S1"): one signature's
    algorithm reused at another size failed with CUBLAS_STATUS_NOT_SUPPORTED on BERT-base (H100)."""
    from plugin_cuda.device.cudnn_conv import forward_geometry
    from plugin_cuda.plan.symint import SymInt

    small, large = SymInt(16, "S0*S1"), SymInt(1024, "S0*S1")
    assert str(small) == str(large)  # what made the keys equal
    assert algo_cache.lt_key("90", small, 768, 768, "bias", 68, 0) != algo_cache.lt_key("90", large, 768, 768, "bias", 68, 0)
    assert algo_cache.lt_key("90", large, 768, 768, "bias", 68, 0) == algo_cache.lt_key("90", 1024, 768, 768, "bias", 68, 0)
    geo = [forward_geometry((SymInt(b, "S0"), 3, 8, 8), (4, 3, 3, 3), (SymInt(b, "S0"), 4, 8, 8), 1, (1, 1), (1, 1),
                            (1, 1), (1, 1)) for b in (1, 8)]
    assert algo_cache.conv_key("90", "forward", geo[0], "float32", False, "HEURISTIC") != \
        algo_cache.conv_key("90", "forward", geo[1], "float32", False, "HEURISTIC")


def test_conv_keys_name_the_whole_geometry():
    from plugin_cuda.device.cudnn_conv import forward_geometry

    geo = forward_geometry((8, 3, 224, 224), (64, 3, 7, 7), (8, 64, 112, 112), 1, (3, 3), (3, 3), (2, 2), (1, 1))
    other = forward_geometry((8, 3, 224, 224), (64, 3, 7, 7), (8, 64, 112, 112), 1, (3, 3), (3, 3), (2, 2), (2, 2))
    key = algo_cache.conv_key("90", "forward", geo, "float32", False, "HEURISTIC")
    assert key != algo_cache.conv_key("90", "forward", other, "float32", False, "HEURISTIC")
    assert key != algo_cache.conv_key("80", "forward", geo, "float32", False, "HEURISTIC")
    assert key != algo_cache.conv_key("90", "forward", geo, "float32", True, "HEURISTIC")


# -- choices made at session creation (plan/prechoose.py), through stand-ins for a Plan and its EP ------------

def _stand_in_plan(calls: list):
    from plugin_cuda.plan.fuse import Step
    from plugin_cuda.plan.program import Op, Value

    values = {0: Value(0, "x", (8, 64, 56, 56)), 1: Value(1, "w", (64, 64, 3, 3)), 2: Value(2, "y", (8, 64, 56, 56)),
              3: Value(3, "b", (64,)), 4: Value(4, "a", (4, 16, 32)), 5: Value(5, "wt", (32, 48)),
              6: Value(6, "bias", (48,)), 7: Value(7, "out", (4, 16, 48))}
    conv = Op("cudnn_conv", "conv0", [0, 1, 3], [2], {"group": 1, "pads": (1, 1), "strides": (1, 1),
                                                      "dilations": (1, 1), "relu": True})
    gemm = Op("gemm", "fc0", [4, 5, 6], [7], {"alpha": 0.5, "epilogue": "relu_bias", "trans_a": 0, "trans_b": 0})
    steps = [Step("cudnn_conv", conv, None, [0, 1, 3], [2], "conv0"), Step("gemm", gemm, None, [4, 5, 6], [7], "fc0"),
             Step("ew", None, None, [7], [7], "relu1")]
    variant = types.SimpleNamespace(name="eager", steps=steps, specs=[None, None, object()])

    class Device:
        def __init__(self, device_id):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Pool:
        def take(self, stream):
            calls.append(("take", stream))
            return "handle"

        def give_back(self, handle):
            calls.append(("give_back", handle))

    made = {}

    def epilogue_gemm(key, make):
        made[key] = make()
        return made[key]

    ep = types.SimpleNamespace(cudnn_handles=Pool())
    plan = types.SimpleNamespace(ep=ep, eager=variant, graph=variant, prog=types.SimpleNamespace(values=values),
                                 cupy=types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device)), device_id=0,
                                 use_tf32=False, _const_base=4096, epilogue_gemm=epilogue_gemm,
                                 location=lambda vid, v: ("const", 512) if vid == 6 else ("arena", 0))
    return plan, steps, made


def test_choices_are_made_at_creation_under_the_keys_the_first_run_uses(monkeypatch):
    from plugin_cuda.device import cublaslt, cudnn_conv
    from plugin_cuda.plan import prechoose

    calls = []
    plan, steps, made = _stand_in_plan(calls)
    monkeypatch.setattr(cudnn_conv, "setup", lambda handle, kind, geo, dtype: calls.append((handle, kind, geo)))
    monkeypatch.setattr(cublaslt, "EpilogueGemm", lambda *a: ("gemm", *a))
    prechoose.make_choices(plan)
    geo = cudnn_conv.forward_geometry((8, 64, 56, 56), (64, 64, 3, 3), (8, 64, 56, 56), 1, (1, 1), (1, 1), (1, 1),
                                      (1, 1))
    assert calls == [("take", 0), ("handle", "forward", geo), ("give_back", "handle")]
    # m = 4 * 16 rows, n = 48, k = 32; the bias at the constant base + its offset; fp32 compute without TF32,
    # float32 operands and the stream's cuBLAS workspace (the first run's step passes the same)
    assert made == {("eager", id(steps[1])): ("gemm", 0, 64, 48, 32, 0.5, 4096 + 512, "relu_bias", 68,
                                              "plan step 'fc0'", 0, 32 << 20, False)}


def test_a_k_major_weight_is_chosen_for_transposed(monkeypatch):
    # fuse.k_major_weights: B stored (N, K) = (48, 32) and read transposed: the same m, n, k, with trans_b
    from plugin_cuda.device import cublaslt, cudnn_conv
    from plugin_cuda.plan import prechoose
    from plugin_cuda.plan.program import Value

    plan, steps, made = _stand_in_plan([])
    plan.prog.values[5] = Value(5, "wt^T", (48, 32))
    steps[1].op.attrs["trans_b"] = True
    monkeypatch.setattr(cudnn_conv, "setup", lambda *a: None)
    monkeypatch.setattr(cublaslt, "EpilogueGemm", lambda *a: ("gemm", *a))
    prechoose.make_choices(plan)
    assert made[("eager", id(steps[1]))][2:5] == (64, 48, 32) and made[("eager", id(steps[1]))][-1] is True


def test_a_failing_choice_is_left_to_the_first_run(monkeypatch):
    from plugin_cuda.device import cudnn_conv
    from plugin_cuda.plan import prechoose

    calls = []
    plan, _, made = _stand_in_plan(calls)

    def refuse(*a):
        raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(cudnn_conv, "setup", refuse)
    prechoose.make_choices(plan)  # no error at creation
    assert calls[-1] == ("give_back", "handle") and made == {}


def test_steps_of_other_types_are_left_to_their_first_run(monkeypatch):
    from plugin_cuda.device import cublaslt, cudnn_conv
    from plugin_cuda.plan import prechoose

    calls = []
    plan, _, made = _stand_in_plan(calls)
    for v in plan.prog.values.values():
        v.dtype = np.dtype(np.float16)  # a half-precision plan: its setups are not float32 ones
    monkeypatch.setattr(cudnn_conv, "setup", lambda *a: calls.append(a))
    monkeypatch.setattr(cublaslt, "EpilogueGemm", lambda *a: ("gemm", *a))
    prechoose.make_choices(plan)
    assert calls == [] and made == {}
