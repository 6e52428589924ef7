import re, warnings, collections
warnings.simplefilter("ignore")
import onnx.backend.test
from host.backend import EphostBackend
import host.cpu_ep as c
backend_test = onnx.backend.test.BackendTest(EphostBackend, __name__)
PREFIX = {
 "And": ["and", r"and\dd"], "Or": ["or", r"or\dd"], "Xor": ["xor", r"xor\dd"],
 "BatchNormalization": ["batchnorm"], "Conv": ["conv", "basic_conv"], "Pad": ["constant_pad", "edge_pad", "reflect_pad", "wrap_pad"],
 "Dropout": ["dropout", "training_dropout"], "Trilu": ["tril", "triu"], "GreaterOrEqual": ["greater_equal"], "LessOrEqual": ["less_equal"],
 "LayerNormalization": ["layer_normalization"],
}
def snake(op):
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", op).lower()
for d, op in c.supported_ops():
    pre = PREFIX.get(op) or ([snake(op)] if op.startswith("Reduce") else [op.lower()])
    for p in pre:
        backend_test.include(rf"^test_{p}(_|$)")
globals().update(backend_test.test_cases)
