//! Number formatting for printouts.

/// `8030261248` -> `8,030,261,248`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `218112000` -> `218.1M`: compact counts for tables.
pub fn si(n: u64) -> String {
    let x = n as f64;
    for (scale, suffix) in [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")] {
        if x >= scale {
            return format!("{:.1}{suffix}", x / scale);
        }
    }
    n.to_string()
}

/// Bytes with binary units: `1.5 GiB`.
pub fn bytes(n: u64) -> String {
    let x = n as f64;
    for (scale, suffix) in [
        (1u64 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ] {
        if n >= scale {
            return format!("{:.1} {suffix}", x / scale as f64);
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(8_030_261_248), "8,030,261,248");
        assert_eq!(si(218_112_000), "218.1M");
        assert_eq!(si(12), "12");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }
}
