"""The training runtime: one model role (``role``: model, optimizer, forward-backward), host offload
(``offload``), resumable checkpoints (``checkpoint``), the final HF export (``export``) and what they write
(``save_size``)."""
