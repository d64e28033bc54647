"""The engine's native code: its C sources (csrc/) and their compile-and-cache (`build`)."""
