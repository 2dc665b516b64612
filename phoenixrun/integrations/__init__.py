"""Thin adapters that give the training loops of other libraries hot swap through the public API
(docs/porting.md). Each imports its library only when used; under plain torchrun each behaves as the library does."""
