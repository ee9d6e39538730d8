"""Pure loss / advantage functions: tensors in, tensors and metrics out."""
