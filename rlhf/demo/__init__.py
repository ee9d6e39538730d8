"""The bundled task of the embedded default job (README command 1)."""
