fn main() {
    afl::fuzz!(|data: &[u8]| tessera_fuzz::chat_template(data));
}
