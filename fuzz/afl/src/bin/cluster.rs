fn main() {
    afl::fuzz!(|data: &[u8]| tessera_fuzz::cluster(data));
}
