//! Binds the fake's references to its own functions locally (`-Bsymbolic`): its
//! `cuGetProcAddress` must hand out its own functions, not a preloaded interposer's
//! same-named wrappers (as the real libcuda does).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
}
