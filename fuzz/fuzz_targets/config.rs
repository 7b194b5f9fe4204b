#![no_main]
// The plugin configuration comes from the operator; a bad one must be refused, never panic.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    idempotency::fuzzing::config(data);
});
