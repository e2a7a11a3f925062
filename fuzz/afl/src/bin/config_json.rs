fn main() {
    afl::fuzz!(|data: &[u8]| tessera_fuzz::config_json(data));
}
