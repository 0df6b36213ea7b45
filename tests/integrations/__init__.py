"""The framework integrations: transformers, accelerate, Lightning."""
