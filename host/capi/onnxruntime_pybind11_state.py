"""onnxruntime's exception classes, as ephost's typed errors (aliases, so `except` clauses catch them).

onnxruntime's names map onto the ephost error that is raised for the same situation. `Fail` is
ephost's base error, so it catches more than onnxruntime's `Fail` does.
"""

from host.errors import EpError, EphostError, InvalidArgument, KernelError, ModelError, NoSuchFile

Fail = EphostError            # any ephost error
InvalidArgument = InvalidArgument
NoSuchFile = NoSuchFile       # the model path names no file
NoModel = ModelError
InvalidProtobuf = ModelError  # model bytes or file that do not parse
InvalidGraph = ModelError     # a model that fails the checker or shape inference
NotImplemented = ModelError   # nodes no EP supports  # noqa: A001 - onnxruntime's name
ModelLoaded = ModelError
EPFail = EpError              # an EP returned an error status
RuntimeException = KernelError  # a kernel failed during a run
EngineError = EpError

__all__ = ["Fail", "InvalidArgument", "NoSuchFile", "NoModel", "InvalidProtobuf", "InvalidGraph", "NotImplemented",
           "ModelLoaded", "EPFail", "RuntimeException", "EngineError"]
