//! fake libcuda
