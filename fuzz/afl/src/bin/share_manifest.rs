fn main() {
    afl::fuzz!(|data: &[u8]| tessera_fuzz::share_manifest(data));
}
