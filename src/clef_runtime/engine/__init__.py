"""The engine: the ``Clef`` facade, batching and caching. Knows nothing of HTTP."""
