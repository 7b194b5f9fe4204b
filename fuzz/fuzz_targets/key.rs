#![no_main]
// The Idempotency-Key header value comes from any client.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    idempotency::fuzzing::key(data);
});
