//! The bench's probes (compute and read) do the work they claim.

mod common;
use common::*;
use tessera_kernels::Isa;

/// The compute probe does the products it claims: its sum over all of them equals the
/// scalar loop's, round count by round count (an ISA that skipped a step or a lane, or
/// ran fewer rounds, would differ).
#[test]
fn mac_probe_simd_matches_scalar() {
    use tessera_kernels::MacKind;
    let isa = Isa::detect();
    let mut previous = 0.0f32;
    for rounds in [1, 2, 7, 9, 40] {
        let int8 = isa.mac_probe(MacKind::Int8, rounds);
        assert_eq!(int8, Isa::Scalar.mac_probe(MacKind::Int8, rounds), "{} int8 probe, {rounds} rounds", isa.name());
        assert!(int8 > previous, "int8 probe sum grows with the rounds");
        previous = int8;
        let (f, s) = (isa.mac_probe(MacKind::F32, rounds), Isa::Scalar.mac_probe(MacKind::F32, rounds));
        assert!(f > 0.0 && close(f, s, 1e-5), "{} f32 probe, {rounds} rounds: {f} vs {s}", isa.name());
    }
    assert_eq!(isa.mac_probe(MacKind::Int8, 0), 0.0);
}

/// The read probe sums what it reads, every element once (a flavour that skipped a block
/// or read past the end would differ), on lengths around its 32-lane blocks.
#[test]
fn read_probe_sums_every_element() {
    for n in [0, 1, 31, 32, 33, 1000, 4096 + 17] {
        let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        let want: f32 = x.iter().sum();
        for isa in [Isa::detect(), Isa::Scalar] {
            assert_eq!(isa.read_probe_sum(&x), want, "{} over {n} floats", isa.name());
        }
    }
}
