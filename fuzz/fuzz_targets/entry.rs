#![no_main]
// Values read back from the store may be corrupt or foreign (another plugin, another version).
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    idempotency::fuzzing::entry(data);
});
