use super::*;

/// `pickle.dumps(obj, protocol=4)` (Python 3.11) of
/// `{"a": Chunk((0, 4), (2, 8)), "b": [shared, shared], "c": OrderedDict(x=1.5),
/// "big": 2**40, "neg": -3, "t": True, "n": None, "s": "é", "by": b"\x00\x01"}`, with
/// `Chunk` a dataclass of `__main__` and `shared = [1, 2]`.
const PROTOCOL_4: &str = "800495bf000000000000007d94288c0161948c085f5f6d61696e5f5f948c054368756e6b9493942981947d94288c076f666673657473944b004b0486948c0573697a6573944b024b08869475628c0162945d94285d94284b014b0265680d658c0163948c0b636f6c6c656374696f6e73948c0b4f726465726564446963749493942952948c017894473ff8000000000000738c03626967948a060000000000018c036e6567944afdffffff8c017494888c016e944e8c0173948c02c3a9948c026279944302000194752e";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn chunk_allowed(g: &Global) -> bool {
    (g.module == "__main__" && g.name == "Chunk") || (g.module == "collections" && g.name == "OrderedDict")
}

fn pair(a: i64, b: i64) -> Value {
    Value::Tuple(vec![Value::Int(a), Value::Int(b)])
}

#[test]
fn reads_what_python_writes_with_protocol_4() {
    let v = read(&unhex(PROTOCOL_4), &chunk_allowed).unwrap();
    let chunk = Value::Object {
        class: Global::new("__main__", "Chunk"),
        by: Construct::New,
        args: vec![],
        state: Some(Box::new(Value::Dict(vec![
            (Value::str("offsets"), pair(0, 4)),
            (Value::str("sizes"), pair(2, 8)),
        ]))),
    };
    assert_eq!(v.get("a"), Some(&chunk));
    let shared = Value::List(vec![Value::Int(1), Value::Int(2)]);
    assert_eq!(v.get("b"), Some(&Value::List(vec![shared.clone(), shared])));
    assert_eq!(
        v.get("c"),
        Some(&Value::Dict(vec![(Value::str("x"), Value::Float(1.5))]))
    );
    assert_eq!(v.get("big"), Some(&Value::Int(1 << 40)));
    assert_eq!(v.get("neg"), Some(&Value::Int(-3)));
    assert_eq!(v.get("t"), Some(&Value::Bool(true)));
    assert_eq!(v.get("n"), Some(&Value::None));
    assert_eq!(v.get("s"), Some(&Value::str("é")));
    assert_eq!(v.get("by"), Some(&Value::Bytes(vec![0, 1])));
}

#[test]
fn a_class_off_the_allow_list_is_refused_by_name() {
    let e = read(&unhex(PROTOCOL_4), &|g: &Global| g.module == "collections").unwrap_err();
    assert!(e.what.contains("`__main__.Chunk`") && e.what.contains("refused"), "{e}");
    // os.system, the classic: GLOBAL 'os' 'system'.
    let evil = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R.";
    let e = read(evil, &chunk_allowed).unwrap_err();
    assert!(e.to_string().contains("`os.system`"), "{e}");
}

#[test]
fn what_it_writes_reads_back() {
    let v = Value::Dict(vec![
        (
            Value::str("chunk"),
            Value::Object {
                class: Global::new("__main__", "Chunk"),
                by: Construct::New,
                args: vec![],
                state: Some(Box::new(Value::Dict(vec![(Value::str("offsets"), pair(0, 4))]))),
            },
        ),
        (
            Value::str("size"),
            Value::Object {
                class: Global::new("collections", "OrderedDict"),
                by: Construct::Call,
                args: vec![Value::List(vec![Value::Int(3)])],
                state: None,
            },
        ),
        (
            Value::str("ints"),
            Value::List(
                [
                    0,
                    255,
                    256,
                    65535,
                    65536,
                    -1,
                    -129,
                    i32::MAX as i64,
                    1 << 31,
                    -(1 << 40),
                    i64::MIN,
                    i64::MAX,
                ]
                .into_iter()
                .map(Value::Int)
                .collect(),
            ),
        ),
        (Value::str("f"), Value::Float(-0.25)),
        (Value::str("long tuple"), Value::Tuple((0..5).map(Value::Int).collect())),
        (Value::str("empty"), Value::Tuple(vec![])),
        (
            Value::str("pid"),
            Value::PersistentId(Box::new(Value::Tuple(vec![Value::str("storage")]))),
        ),
        (Value::str("g"), Value::Global(Global::new("__main__", "Chunk"))),
        (Value::str("b"), Value::Bytes(vec![9; 3])),
    ]);
    let bytes = write(&v);
    assert_eq!(bytes[1], 3, "bytes need protocol 3");
    assert_eq!(read(&bytes, &chunk_allowed).unwrap(), v);
    let plain = write(&Value::List(vec![Value::None]));
    assert_eq!(&plain[..2], &[0x80, 2]);
}

#[test]
fn broken_and_hostile_pickles_are_refused_not_panicked() {
    let good = unhex(PROTOCOL_4);
    for cut in 0..good.len() {
        assert!(read(&good[..cut], &chunk_allowed).is_err(), "cut at {cut}");
    }
    let cases: Vec<(&[u8], &str)> = vec![
        (b"\x80\x02N.N", "after the pickle's end"),
        (b"\x80\x06N.", "protocol 6"),
        (b"\x80\x02X\xff\xff\xff\x7f.", "past the pickle's end"),
        (b"\x80\x02h\x05.", "memo entry 5"),
        (b"\x80\x02a.", "empty stack"),
        (b"\x80\x02(.", "a mark where a value"),
        (b"\x80\x02Ne.", "no mark"),
        (b"\x80\x02J\x01\x02", "ends inside"),
        (b"\x80\x02\x8a\x09\x01\x02\x03\x04\x05\x06\x07\x08\x09.", "9 bytes"),
        (b"\x80\x02I1\n.", "opcode 0x49"),
        (b"\x80\x02NNR.", "not a named class"),
        (b"\x80\x02X\x02\x00\x00\x00\xff\xfe.", "not UTF-8"),
        // A list that contains itself: [] memoised, then appended to itself.
        (b"\x80\x02]q\x00h\x00a.", "contains itself"),
    ];
    for (bytes, want) in cases {
        let e = read(bytes, &chunk_allowed).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
}

#[test]
fn a_memo_bomb_is_refused() {
    // A list of 1 KiB, then 40 times: a list of the previous one twice. 2^40 KiB unfolded.
    let mut p = b"\x80\x02".to_vec();
    p.extend_from_slice(b"X\x00\x04\x00\x00");
    p.extend(std::iter::repeat_n(b'a', 1024));
    p.extend_from_slice(b"q\x00");
    for i in 1..=40u8 {
        p.extend_from_slice(&[b'(', b'h', i - 1, b'h', i - 1, b'l', b'q', i, b'0']);
    }
    p.extend_from_slice(&[b'h', 40, b'.']);
    let e = read(&p, &chunk_allowed).unwrap_err();
    assert!(e.what.contains("memo bomb"), "{e}");
}
