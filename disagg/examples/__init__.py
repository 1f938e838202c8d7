"""Small recommendation models served as user models (``model.factory``), each a module with a factory function of
no arguments (``build``) whose docstring gives the signature its Serve config declares (``deploy/examples/``).
Their values come from the torch seed the factory runs under (``model.seed``) or from a weights file
(``model.weights``); every one traces with torch.fx and looks its tables up with ``nn.Embedding`` /
``nn.EmbeddingBag`` modules, so it serves disaggregated: tables on the embedding shards, the rest on the dense side.
"""
