//! gpucr CRIU plugin (CRIU 4.x plugin ABI).
