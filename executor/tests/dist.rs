//! The launcher environments and the TCP process world: parsed with clear errors, exact
//! collectives, strangers turned away, and never a hang.

use candle_core::{DType, Device, Tensor};
use shardplan_executor::comm::env::{DistEnv, Launcher, ProcessEnv};
use shardplan_executor::comm::tcp::TcpWorld;
use shardplan_executor::comm::{all_gather_bytes, Abort, Collectives, Reduce};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
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

fn dist(rank: u64, world: u64, port: u16) -> DistEnv {
    DistEnv {
        rank,
        world_size: world,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

fn abort_after(t: Duration) -> Arc<Abort> {
    let a = Arc::new(Abort::default());
    a.set_timeout(t);
    a
}

/// Runs `f` on every rank of a TCP world of `world` processes (threads here).
fn with_world<T: Send>(world: u64, f: impl Fn(u64, TcpWorld) -> T + Sync) -> Vec<T> {
    let port = free_port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let w = TcpWorld::connect(&dist(rank, world, port), abort_after(Duration::from_secs(20))).unwrap();
                    f(rank, w)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn the_tcp_world_computes_what_the_local_backend_does() {
    let got = with_world(4, |rank, w| {
        let x = Tensor::new(&[rank as f32 + 0.5, 10.0 * rank as f32], &Device::Cpu).unwrap();
        let gathered = w.all_gather(0, &x).unwrap().to_vec1::<f32>().unwrap();
        let summed = w.all_reduce(1, &x, Reduce::Sum).unwrap().to_vec1::<f32>().unwrap();
        let avg = w
            .all_reduce(2, &x.to_dtype(DType::F64).unwrap(), Reduce::Avg)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let eight = Tensor::arange(0f32, 8.0, &Device::Cpu).unwrap();
        let part = w
            .reduce_scatter(3, &(eight * (rank as f64 + 1.0)).unwrap(), Reduce::Sum)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = w.broadcast(4, &x.to_dtype(DType::BF16).unwrap()).unwrap();
        w.barrier(5).unwrap();
        let bytes = all_gather_bytes(&w, 6, &vec![rank as u8; rank as usize]).unwrap();
        (
            gathered,
            summed,
            avg,
            part,
            b.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
            bytes,
        )
    });
    for (rank, (gathered, summed, avg, part, b, bytes)) in got.into_iter().enumerate() {
        assert_eq!(gathered, vec![0.5, 0.0, 1.5, 10.0, 2.5, 20.0, 3.5, 30.0]);
        assert_eq!(summed, vec![8.0, 60.0]);
        assert_eq!(avg, vec![2.0, 15.0]);
        // Sum of (r + 1) * [0..8) over r = 10 * [0..8); rank r holds elements 2r, 2r + 1.
        assert_eq!(part, vec![20.0 * rank as f32, 20.0 * rank as f32 + 10.0]);
        assert_eq!(b, vec![0.5, 0.0]);
        assert_eq!(bytes, (0..4u8).map(|r| vec![r; r as usize]).collect::<Vec<_>>());
    }
}

#[test]
fn an_unreachable_master_fails_with_the_address_and_a_timeout() {
    let port = free_port();
    let start = Instant::now();
    let err = TcpWorld::connect(&dist(2, 4, port), abort_after(Duration::from_millis(800)))
        .err()
        .unwrap()
        .to_string();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(
        err.contains(&format!("rank 2: cannot reach MASTER_ADDR 127.0.0.1:{port} within")),
        "{err}"
    );
    // Rank 0 waiting for peers that never come gives up too, naming them.
    let err = TcpWorld::connect(&dist(0, 4, port), abort_after(Duration::from_millis(500)))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("only 0 of 3 ranks reached") && err.contains("missing ranks 1, 2, 3"),
        "{err}"
    );
}

#[test]
fn strangers_on_the_port_are_turned_away_and_impostors_refused() {
    let port = free_port();
    let got = std::thread::scope(|s| {
        let zero = s.spawn(move || {
            TcpWorld::connect(&dist(0, 2, port), abort_after(Duration::from_secs(20))).map(|w| {
                w.all_reduce(0, &Tensor::new(&[1f32], &Device::Cpu).unwrap(), Reduce::Sum)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
        });
        // A port scanner and an HTTP client come first; rank 0 drops them and keeps waiting.
        let mut tries = 0;
        let mut c = loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(c) => break c,
                Err(_) if tries < 200 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("{e}"),
            }
        };
        c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut buf = Vec::new();
        let _ = c.read_to_end(&mut buf);
        assert!(buf.is_empty(), "a stranger gets no answer");
        drop(std::net::TcpStream::connect(("127.0.0.1", port)).unwrap());
        let one = TcpWorld::connect(&dist(1, 2, port), abort_after(Duration::from_secs(20))).unwrap();
        let mine = one
            .all_reduce(0, &Tensor::new(&[2f32], &Device::Cpu).unwrap(), Reduce::Sum)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        (zero.join().unwrap().unwrap(), mine)
    });
    assert_eq!(got, (vec![3.0], vec![3.0]));

    // A rank that says another world size is refused by name.
    let port = free_port();
    let err = std::thread::scope(|s| {
        let zero = s.spawn(move || TcpWorld::connect(&dist(0, 2, port), abort_after(Duration::from_secs(20))).err());
        std::thread::sleep(Duration::from_millis(100));
        let _ = TcpWorld::connect(&dist(1, 3, port), abort_after(Duration::from_secs(2)));
        zero.join().unwrap()
    })
    .unwrap()
    .to_string();
    assert!(err.contains("says WORLD_SIZE=3, this rank says 2"), "{err}");
}

#[test]
fn a_dead_or_disagreeing_process_stops_the_world_with_the_reason() {
    // Rank 1 dies after joining: rank 0's next collective fails at once, naming it.
    let got = with_world(2, |rank, w| {
        if rank == 1 {
            drop(w);
            return String::new();
        }
        let start = Instant::now();
        let e = w.barrier(0).unwrap_err().to_string();
        assert!(start.elapsed() < Duration::from_secs(10));
        e
    });
    assert!(got[0].contains("rank 1 closed the connection"), "{}", got[0]);
    // Ranks issuing different collectives: both stop, saying the schedules disagree.
    let got = with_world(2, |rank, w| {
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let r = if rank == 0 {
            w.all_gather(7, &x).map(|_| ())
        } else {
            w.all_reduce(7, &x, Reduce::Sum).map(|_| ())
        };
        r.unwrap_err().to_string()
    });
    assert!(got[0].contains("the processes' schedules disagree"), "{}", got[0]);
    assert!(!got[1].is_empty());
    // A silent peer: the collective times out instead of hanging.
    let port = free_port();
    let got = std::thread::scope(|s| {
        let h = s.spawn(move || {
            let w = TcpWorld::connect(&dist(1, 2, port), abort_after(Duration::from_secs(20))).unwrap();
            std::thread::sleep(Duration::from_millis(1500));
            drop(w);
        });
        let abort = abort_after(Duration::from_secs(20));
        let w = TcpWorld::connect(&dist(0, 2, port), abort.clone()).unwrap();
        abort.set_timeout(Duration::from_millis(300));
        let start = Instant::now();
        let e = w.barrier(0).unwrap_err().to_string();
        let el = start.elapsed();
        h.join().unwrap();
        (e, el)
    });
    assert!(got.0.contains("rank 1 sent nothing for 0.3 s"), "{}", got.0);
    assert!(got.1 < Duration::from_secs(1), "{:?}", got.1);
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
