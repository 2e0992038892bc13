//! The torchrun environment and the TCP rendezvous: parsed with clear errors, and never a hang.

use shardplan_executor::comm::env::{DistEnv, Launcher, ProcessEnv};
use shardplan_executor::comm::rendezvous::rendezvous;
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn env(vars: &[(&str, &str)]) -> Result<Option<DistEnv>, String> {
    let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    DistEnv::from_vars(|k| m.get(k).cloned()).map_err(|e| e.to_string())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn the_environment_is_parsed_or_refused_by_name() {
    assert_eq!(env(&[]).unwrap(), None, "no variables: one process");
    let full = [
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let e = env(&full).unwrap().unwrap();
    assert_eq!((e.rank, e.world_size, e.local_rank, e.master_port), (1, 4, 1, 29500));
    let e = env(&full[..4]).unwrap_err();
    assert!(e.contains("MASTER_PORT is not set"), "{e}");
    let mut bad = full;
    bad[0] = ("RANK", "four");
    assert!(env(&bad)
        .unwrap_err()
        .contains("RANK=\"four\" is not a non-negative integer"));
    bad[0] = ("RANK", "4");
    assert!(env(&bad).unwrap_err().contains("RANK=4 is not below WORLD_SIZE=4"));
    let mut port = full;
    port[4] = ("MASTER_PORT", "99999");
    assert!(env(&port)
        .unwrap_err()
        .contains("MASTER_PORT=\"99999\" is not a port number"));
}

#[test]
fn rank_0_hands_its_payload_to_every_rank() {
    let port = free_port();
    let world = 4;
    let payload: Vec<u8> = (0..128u8).collect();
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let payload = payload.clone();
                s.spawn(move || {
                    let e = DistEnv {
                        rank,
                        world_size: world,
                        local_rank: rank,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                    };
                    let mine = if rank == 0 { payload } else { Vec::new() };
                    rendezvous(&e, &mine, Duration::from_secs(20)).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in got {
        assert_eq!(g, payload);
    }
}

#[test]
fn an_unreachable_master_fails_with_the_address_and_a_timeout() {
    let port = free_port();
    let e = DistEnv {
        rank: 2,
        world_size: 4,
        local_rank: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    };
    let start = Instant::now();
    let err = rendezvous(&e, &[], Duration::from_millis(800)).unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(
        err.contains(&format!("rank 2: cannot reach MASTER_ADDR 127.0.0.1:{port} within")),
        "{err}"
    );
    // Rank 0 waiting for peers that never come gives up too.
    let zero = DistEnv { rank: 0, ..e };
    let err = rendezvous(&zero, b"id", Duration::from_millis(500))
        .unwrap_err()
        .to_string();
    assert!(err.contains("only 0 of 3 ranks reached"), "{err}");
}

fn process(vars: &[(&str, &str)]) -> Result<Option<ProcessEnv>, String> {
    let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    ProcessEnv::from_vars(|k| m.get(k).cloned()).map_err(|e| e.to_string())
}

#[test]
fn each_launcher_is_recognised() {
    assert_eq!(process(&[]).unwrap(), None);
    let m = process(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(
        (m.launcher, m.rank, m.world_size, m.local_rank),
        (Launcher::Mpirun, 2, 4, 0)
    );
    // PMIx names the rank when Open MPI's own variable is absent.
    let m = process(&[("PMIX_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4")])
        .unwrap()
        .unwrap();
    assert_eq!((m.launcher, m.rank), (Launcher::Mpirun, 3));
    let s = process(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")])
        .unwrap()
        .unwrap();
    assert_eq!(
        (s.launcher, s.rank, s.world_size, s.local_rank),
        (Launcher::Srun, 5, 8, 1)
    );
    // torchrun's variables are explicit and win over a surrounding Slurm job's.
    let t = process(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!((t.launcher, t.rank, t.world_size), (Launcher::Torchrun, 1, 2));
    assert!(t.torchrun.is_some());
}

#[test]
fn broken_launcher_variables_are_refused_by_name() {
    let e = process(&[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")]).unwrap_err();
    assert!(e.contains("rank 4 is not below the world size 4"), "{e}");
    let e = process(&[("OMPI_COMM_WORLD_RANK", "1")]).unwrap_err();
    assert!(e.contains("OMPI_COMM_WORLD_SIZE") && e.contains("only some"), "{e}");
    let e = process(&[("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")]).unwrap_err();
    assert!(e.contains("SLURM_PROCID=\"x\" is not a non-negative integer"), "{e}");
    let e = process(&[("SLURM_NTASKS", "2")]).unwrap_err();
    assert!(e.contains("SLURM_PROCID"), "{e}");
}
