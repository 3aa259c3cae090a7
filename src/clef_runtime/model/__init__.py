"""The Clef model: release resolution and verification, the Qwen3.5 backbone, the joint schema head.

Importing this package imports torch; the protocol and encoding layers never do.
"""
