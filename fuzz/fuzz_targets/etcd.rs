#![no_main]
// etcd's answers (and values another writer left in etcd) are untrusted input.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    idempotency::fuzzing::etcd(data);
});
