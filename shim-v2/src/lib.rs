//! gpucr shim library
