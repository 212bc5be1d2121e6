//! Feeds arbitrary bytes to the manifest parser: it must return, never panic, and
//! whatever it accepts must survive a serialize/parse round trip unchanged.
#![no_main]

use std::path::Path;

use gpu_state::image::Manifest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(manifest) = Manifest::parse(data, Path::new("fuzz")) {
        let again = Manifest::parse(&manifest.to_json(), Path::new("fuzz-again"))
            .expect("a parsed manifest serializes to a valid one");
        assert_eq!(manifest, again);
    }
});
