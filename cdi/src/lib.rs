//! gpucr-cdi: the host-specific parts of a container spec.
