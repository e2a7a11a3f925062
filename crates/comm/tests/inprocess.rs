//! Ranks as threads of one process over loopback, with the hostfile-style address table:
//! mesh formation from a table, doctor, argument errors and group rules.

use std::net::TcpListener;
use tessera_comm::doctor::{self, DoctorOptions};
use tessera_comm::{CommConfig, CommError, Communicator, Listening, Peers};

/// Forms an n-rank cluster from a table of pre-bound loopback ports and runs `f` on every
/// rank in its own thread; returns each rank's result.
fn cluster<R: Send + 'static>(n: usize, f: impl Fn(Communicator) -> R + Send + Sync + 'static) -> Vec<R> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let table: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let mut cfg = CommConfig::new(rank, n, Peers::Table(table.clone()), b"in-process-test-secret-0123456789".to_vec());
            cfg.op_deadline_ms = 10_000;
            cfg.connect_timeout_ms = 10_000;
            cfg.close_linger_ms = 200;
            let f = f.clone();
            std::thread::spawn(move || {
                let comm = Communicator::from_listening(Listening::from_listener(cfg, l).unwrap()).unwrap();
                f(comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn hostfile_table_mesh_runs_collectives() {
    let sums = cluster(3, |c| {
        let mut x = vec![c.rank() as i32 + 1; 10];
        c.all_reduce_sum(&mut x, "table mesh").unwrap();
        c.barrier("end").unwrap();
        x[9]
    });
    assert_eq!(sums, vec![6, 6, 6]);
}

#[test]
fn doctor_reports_every_link_and_size() {
    let reports = cluster(3, |c| {
        let opts = DoctorOptions { pings: 20, bandwidth_bytes: 1 << 20, bandwidth_repeats: 2 };
        doctor::run(&c, &opts).unwrap()
    });
    for r in &reports {
        assert_eq!(r.world_size, 3);
        for i in 0..3 {
            for j in 0..3 {
                let (rtt, bw) = (r.link_rtt_us[i][j], r.link_bandwidth_gbps[i][j]);
                if i == j {
                    assert_eq!((rtt, bw), (0.0, 0.0));
                } else {
                    assert!(rtt > 0.0 && bw > 0.0, "link {i}-{j}: {rtt} us {bw} GB/s");
                    assert_eq!(rtt, r.link_rtt_us[j][i]);
                }
            }
        }
        assert_eq!(r.all_reduce.iter().map(|s| s.bytes).collect::<Vec<_>>(), doctor::ALLREDUCE_BYTES.to_vec());
        assert!(r.all_reduce.iter().all(|s| s.latency_us_median > 0.0 && s.latency_us_p99 >= s.latency_us_median));
    }
    // Every rank sees the same link matrix (it was summed across the cluster).
    assert_eq!(reports[0].link_rtt_us, reports[2].link_rtt_us);
    let text = reports[0].to_string();
    assert!(text.contains("link round trip") && text.contains("16 MiB"), "{text}");
    let json: serde_json::Value = serde_json::from_str(&reports[0].to_json()).unwrap();
    assert_eq!(json["all_reduce"].as_array().unwrap().len(), 5);
}

/// A rank that passes a wrongly sized buffer fails with an argument error, and its peers
/// stop at once with the same diagnosis instead of waiting for their deadline.
#[test]
fn bad_arguments_abort_the_cluster() {
    let errs = cluster(3, |c| {
        let send = vec![1f32; 4];
        let mut recv = vec![0f32; if c.rank() == 1 { 11 } else { 12 }];
        let t = std::time::Instant::now();
        let e = c.all_gather(&send, &mut recv, "gather").unwrap_err();
        // Every later operation reports the same cluster diagnosis.
        let again = c.barrier("after").unwrap_err();
        (e.root_kind().to_string(), e.to_string(), again.root_kind().to_string(), t.elapsed().as_millis())
    });
    for (rank, (root, text, again, ms)) in errs.iter().enumerate() {
        assert_eq!(root, "invalid_argument", "rank {rank}: {text}");
        assert_eq!(again, "invalid_argument");
        assert!(text.contains("recv has 11 elements"), "rank {rank}: {text}");
        assert!(*ms < 5_000, "rank {rank} took {ms} ms");
    }
}

#[test]
fn limits_and_group_rules_are_errors() {
    let out = cluster(2, |c| {
        let g_err = c.group(&[1, 0]).err().map(|e| e.to_string());
        let g_out = if c.rank() == 0 { c.group(&[1]).err().map(|e| e.to_string()) } else { None };
        let mut x = [0u8; 4];
        let tag = "t".repeat(65);
        let e = c.all_reduce_sum(&mut x, &tag).unwrap_err();
        (g_err, g_out, e)
    });
    for (g_err, g_out, e) in &out {
        assert!(g_err.as_deref().unwrap().contains("sorted"));
        assert!(matches!(e, CommError::InvalidArgument { .. } | CommError::Aborted { .. }), "{e}");
        assert!(e.to_string().contains("TAG_BYTES_MAX=64"), "{e}");
        let _ = g_out;
    }
    assert!(out[0].1.as_deref().unwrap().contains("not a member"));
}
