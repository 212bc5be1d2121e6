//! gpucr-hook: the in-container CUDA interceptor (not built out yet; see docs/ARCHITECTURE.md).
