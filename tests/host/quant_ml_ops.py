"""The ops whose cases live in test_quantized.py, test_matmul_nbits.py and test_ml_ops.py (compared with onnxruntime there,
not with onnx's reference as in test_cpu_ops.py); test_cpu_ops.test_every_registered_op_has_a_case
counts them as covered."""

QUANT_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "QLinearMatMul",
    "QLinearConv", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearAveragePool", "QLinearSoftmax",
    "QLinearSigmoid", "QLinearLeakyRelu", "QLinearConcat", "QGemm", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
    "MatMulNBits",
})
ML_OPS = frozenset({
    "TreeEnsembleClassifier", "TreeEnsembleRegressor", "TreeEnsemble", "LinearClassifier", "LinearRegressor",
    "SVMClassifier", "SVMRegressor", "Scaler", "Normalizer", "Binarizer", "Imputer", "OneHotEncoder", "LabelEncoder",
    "CategoryMapper", "ArrayFeatureExtractor", "FeatureVectorizer", "ZipMap", "DictVectorizer",
})
