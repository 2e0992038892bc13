//! Pipeline schedules as torch.distributed.pipelining's CSV files (`_dump_csv`, `_load_csv`):
//! one row a rank, rank 0 first, one action a cell in torch's text form (`2F0`, `1B3`,
//! `(0F3;1B2)OVERLAP_F_B`, `0SEND_F1`). torch has two formats: "compute_only", where an empty
//! cell is an idle slot ([`write_csv`], [`read_csv`]), and "compute_comms", a lowered program
//! with no empty cell ([`write_lowered_csv`], [`read_lowered_csv`]).
//!
//! What is written is byte for byte what torch's `csv.writer` writes (`\r\n` after each row).
//! What is read is what torch's `csv.reader` reads, with two differences: a cell must be a
//! whole action (torch reads `2F0x` as `2F0`, and `1UNSHARD3` as an UNSHARD with a
//! micro-batch), and a UTF-8 byte-order mark before the first cell is skipped (torch keeps it
//! in the cell and fails). As in torch, a blank line is a rank with no action and a cell of
//! spaces is empty.
//!
//! A schedule file is untrusted input: reading never panics and stops at the bounds below.

use super::action::{Action, ActionParseError};
use ::csv::{ByteRecord, ReaderBuilder, Terminator, WriterBuilder};
use std::fmt;

/// The largest schedule file read, in bytes. The largest lowered programs shardplan builds
/// at sizes anyone runs (Interleaved 1F1B or Interleaved zero-bubble, 64 ranks, 4 stages a
/// rank, 256 micro-batches) write 6.4 and 6.8 MB, their compute-only schedules 1.0 and
/// 1.4 MB; 16 MiB leaves twice that room.
pub const MAX_CSV_BYTES: usize = 16 << 20;

/// The most cells (actions and idle slots, all rows together) a schedule file may have.
/// Those lowered programs have 525,056 and 590,464 actions; 2^21 cells is 3.5 times that,
/// and bounds what a file of [`MAX_CSV_BYTES`] made of empty cells (one byte each) would
/// otherwise hold in memory, 32 bytes a cell, to 64 MiB.
pub const MAX_CELLS: usize = 1 << 21;

/// The most rows (ranks) a schedule file may have: pipeline parallelism stops paying long
/// before 4096 stages (each rank adds a bubble), so more rows mean a file that is not a
/// schedule.
pub const MAX_RANKS: usize = 4096;

/// Where a cell is: the rank (its row, from 0) and slot (its position in the row, from 0),
/// and where a user sees it: the 1-based line of the file and column of the row, as a
/// spreadsheet numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellAt {
    pub rank: u32,
    pub slot: usize,
    pub line: u64,
    pub column: usize,
}

impl fmt::Display for CellAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}, column {} (cell {}: rank {}, slot {})",
            self.line,
            self.column,
            cell_name(self.rank, self.slot),
            self.rank,
            self.slot
        )
    }
}

/// A spreadsheet's name of the cell holding `rank`'s action at `slot` (`A1` is rank 0's
/// first slot, `C2` rank 1's third).
pub fn cell_name(rank: u32, slot: usize) -> String {
    let mut letters = Vec::new();
    let mut n = slot as u128 + 1;
    while n > 0 {
        n -= 1;
        letters.push(b'A' + (n % 26) as u8);
        n /= 26;
    }
    letters.reverse();
    format!("{}{}", String::from_utf8_lossy(&letters), u64::from(rank) + 1)
}

/// Why one cell of a schedule file is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CellError {
    #[error(transparent)]
    Action(#[from] ActionParseError),
    #[error("the cell is empty, but a lowered (compute_comms) program has no idle slot")]
    Empty,
}

/// Why a schedule file could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CsvError {
    #[error("the schedule file is {bytes} bytes, more than the {MAX_CSV_BYTES} a schedule may take")]
    TooLarge { bytes: usize },
    #[error("line {line}: the schedule has more than {MAX_RANKS} rows, one a rank")]
    TooManyRanks { line: u64 },
    #[error("line {line}: the schedule has more than {MAX_CELLS} cells")]
    TooManyCells { line: u64 },
    #[error("line {line}: {message}")]
    Syntax { line: u64, message: String },
    #[error("{at}: {reason}")]
    Cell { at: CellAt, reason: CellError },
}

impl CsvError {
    /// The cell the error is in, if it is in one.
    pub fn cell(&self) -> Option<CellAt> {
        match self {
            CsvError::Cell { at, .. } => Some(*at),
            _ => None,
        }
    }
}

/// A compute-only schedule in torch's "compute_only" CSV: `None` is an empty cell (an idle
/// slot). Rows keep their own lengths, as torch writes them.
pub fn write_csv(rows: &[Vec<Option<Action>>]) -> String {
    write_rows(rows.iter().map(|row| {
        row.iter()
            .map(|cell| cell.as_ref().map(Action::to_string).unwrap_or_default())
            .collect()
    }))
}

/// A lowered program (compute, FSDP and communication actions) in torch's "compute_comms"
/// CSV.
pub fn write_lowered_csv(rows: &[Vec<Action>]) -> String {
    write_rows(rows.iter().map(|row| row.iter().map(Action::to_string).collect()))
}

/// Rows of cells written as Python's `csv.writer` writes them: `\r\n` after each row, a
/// row of one empty cell as `""` (so that it does not read back as a blank line), a row of
/// no cell as a blank line (the csv crate would write `""` for it too).
fn write_rows(rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut builder = WriterBuilder::new();
    builder.flexible(true).terminator(Terminator::CRLF);
    let mut out: Vec<u8> = Vec::new();
    for row in rows {
        if row.is_empty() {
            out.extend_from_slice(b"\r\n");
            continue;
        }
        let mut writer = builder.from_writer(&mut out);
        // Writing into memory fails only if the allocator does.
        writer.write_record(&row).expect("writes to memory");
        writer.flush().expect("writes to memory");
    }
    // Every cell is an action's text or empty: ASCII.
    String::from_utf8(out).expect("actions are ASCII")
}

/// A schedule in either of torch's CSV formats: one row a rank, `None` for an empty cell.
/// Refuses a cell that is not an action, naming its line and column.
pub fn read_csv(text: &str) -> Result<Vec<Vec<Option<Action>>>, CsvError> {
    read_cells(text, Ok)
}

/// A lowered program in torch's "compute_comms" CSV: as [`read_csv`], but an empty cell is
/// refused, as torch refuses it (a lowered program has no idle slot).
pub fn read_lowered_csv(text: &str) -> Result<Vec<Vec<Action>>, CsvError> {
    read_cells(text, |cell| cell.ok_or(CellError::Empty))
}

/// Every record of `text`, each cell parsed and then passed through `keep`; a blank line
/// is a rank with no action, as Python's `csv.reader` reads it.
fn read_cells<T>(text: &str, keep: impl Fn(Option<Action>) -> Result<T, CellError>) -> Result<Vec<Vec<T>>, CsvError> {
    if text.len() > MAX_CSV_BYTES {
        return Err(CsvError::TooLarge { bytes: text.len() });
    }
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut rows = Vec::new();
    let mut cells = 0;
    for (line, record) in split_records(text) {
        if rows.len() >= MAX_RANKS {
            return Err(CsvError::TooManyRanks { line });
        }
        let rank = rows.len() as u32;
        let record = split_cells(record, line)?;
        cells += record.len();
        if cells > MAX_CELLS {
            return Err(CsvError::TooManyCells { line });
        }
        let row = record
            .iter()
            .enumerate()
            .map(|(slot, cell)| {
                let at = CellAt {
                    rank,
                    slot,
                    line,
                    column: slot + 1,
                };
                parse_cell(cell)
                    .and_then(&keep)
                    .map_err(|reason| CsvError::Cell { at, reason })
            })
            .collect::<Result<Vec<T>, CsvError>>()?;
        rows.push(row);
    }
    Ok(rows)
}

/// `text` cut into records, each with the line it starts on and without its line break,
/// as Python's `csv.reader` cuts it: `\r\n`, `\n` or `\r` ends a record, except inside a
/// quoted field (one whose first character is `"`; `""` in it is a quote). The csv crate
/// cannot do this: it skips blank lines, which torch reads as ranks.
fn split_records(text: &str) -> Vec<(u64, &str)> {
    let bytes = text.as_bytes();
    let mut records = Vec::new();
    let (mut start, mut line, mut start_line) = (0, 1u64, 1u64);
    let (mut field_start, mut quoted) = (true, false);
    let mut at = 0;
    while at < bytes.len() {
        let byte = bytes[at];
        let crlf = byte == b'\r' && bytes.get(at + 1) == Some(&b'\n');
        match byte {
            b'"' if quoted && bytes.get(at + 1) == Some(&b'"') => at += 1,
            b'"' if quoted => quoted = false,
            b'"' if field_start => quoted = true,
            b'\r' | b'\n' if quoted => line += u64::from(!crlf),
            b'\r' | b'\n' => {
                records.push((start_line, &text[start..at]));
                at += usize::from(crlf);
                (start, line) = (at + 1, line + 1);
                start_line = line;
            }
            _ => {}
        }
        field_start = !quoted && matches!(byte, b',' | b'\r' | b'\n');
        at += 1;
    }
    if start < bytes.len() {
        records.push((start_line, &text[start..]));
    }
    records
}

/// The cells of one record (no line break in it outside quotes): none for an empty record.
fn split_cells(record: &str, line: u64) -> Result<ByteRecord, CsvError> {
    if record.is_empty() {
        return Ok(ByteRecord::new());
    }
    let mut reader = ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(record.as_bytes());
    let mut cells = ByteRecord::new();
    let syntax = |message: String| CsvError::Syntax { line, message };
    reader.read_byte_record(&mut cells).map_err(|e| syntax(e.to_string()))?;
    let mut more = ByteRecord::new();
    if reader.read_byte_record(&mut more).map_err(|e| syntax(e.to_string()))? {
        return Err(syntax(
            "a line break inside a record that the reader cannot place".into(),
        ));
    }
    Ok(cells)
}

/// One cell: `None` when empty or only whitespace, else the action it spells. (The csv
/// crate splits UTF-8 text at ASCII bytes only, so a cell is UTF-8.)
fn parse_cell(cell: &[u8]) -> Result<Option<Action>, CellError> {
    let text = String::from_utf8_lossy(cell);
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    Ok(Some(text.parse()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn action(text: &str) -> Action {
        text.parse().unwrap()
    }

    fn row(cells: &[&str]) -> Vec<Option<Action>> {
        cells.iter().map(|c| (!c.is_empty()).then(|| action(c))).collect()
    }

    #[test]
    fn writes_as_python_csv_writer_does() {
        let rows = vec![
            row(&["0F0", "", "0B0"]),
            row(&["", "1F0", "(0F3;1B2)OVERLAP_F_B", ""]),
            row(&[""]),
            row(&[]),
        ];
        let text = write_csv(&rows);
        assert_eq!(text, "0F0,,0B0\r\n,1F0,(0F3;1B2)OVERLAP_F_B,\r\n\"\"\r\n\r\n");
        assert_eq!(read_csv(&text).unwrap(), rows);
        let lowered = vec![vec![action("0UNSHARD"), action("0F0"), action("0SEND_F0")], vec![]];
        let text = write_lowered_csv(&lowered);
        assert_eq!(text, "0UNSHARD,0F0,0SEND_F0\r\n\r\n");
        assert_eq!(read_lowered_csv(&text).unwrap(), lowered);
    }

    #[test]
    fn reads_blank_lines_as_ranks_with_no_action() {
        for text in [
            "0F0\r\n\r\n1F0\r\n\r\n",
            "0F0\n\n1F0\n\n",
            "0F0\r\r1F0\r\r",
            "0F0\n\n1F0\n\r\n",
        ] {
            let rows = read_csv(text).unwrap();
            assert_eq!(rows, vec![row(&["0F0"]), row(&[]), row(&["1F0"]), row(&[])], "{text:?}");
        }
        assert_eq!(read_csv("").unwrap(), Vec::<Vec<Option<Action>>>::new());
        assert_eq!(read_csv("0F0").unwrap(), vec![row(&["0F0"])]);
        assert_eq!(read_csv("\n0F0\n").unwrap(), vec![row(&[]), row(&["0F0"])]);
        // A quote left open runs to the end of the file, as in Python.
        assert_eq!(read_csv("\"").unwrap(), vec![row(&[""])]);
        assert_eq!(read_csv("0F0,\"1F0\n\n").unwrap(), vec![row(&["0F0", "1F0"])]);
    }

    #[test]
    fn reads_spaces_quotes_and_a_byte_order_mark() {
        let rows = read_csv("\u{feff} 0F0 ,  ,\"1B2\"\r\n\"(0F3;1B2)OVERLAP_F_B\"\r\n").unwrap();
        assert_eq!(rows, vec![row(&["0F0", "", "1B2"]), row(&["(0F3;1B2)OVERLAP_F_B"])]);
    }

    #[test]
    fn a_bad_cell_is_named_by_line_column_rank_and_slot() {
        let err = read_csv("0F0,0B0\n\n1F0,,1X0,1B0\n").unwrap_err();
        let at = CellAt {
            rank: 2,
            slot: 2,
            line: 3,
            column: 3,
        };
        assert_eq!(err.cell(), Some(at));
        let text = err.to_string();
        assert!(
            text.starts_with("line 3, column 3 (cell C3: rank 2, slot 2): `1X0`"),
            "{text}"
        );
        assert!(text.contains("no action kind"), "{text}");
        // A quoted cell over two lines: the next record's line is the file's.
        let err = read_csv("\"0F0\n\",0B0\n1F0,2F0x\n").unwrap_err();
        assert_eq!(err.cell().map(|at| (at.line, at.rank, at.slot)), Some((3, 1, 1)));
    }

    #[test]
    fn a_lowered_program_has_no_empty_cell() {
        let err = read_lowered_csv("0F0,0SEND_F0\n1RECV_F0,,1F0\n").unwrap_err();
        assert!(
            matches!(
                err,
                CsvError::Cell {
                    reason: CellError::Empty,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(err.cell().map(|at| (at.line, at.column)), Some((2, 2)));
    }

    #[test]
    fn refuses_what_is_too_large() {
        let big = "0F0,".repeat(MAX_CSV_BYTES / 4 + 1);
        assert!(matches!(read_csv(&big), Err(CsvError::TooLarge { .. })));
        let many = "0F0\n".repeat(MAX_RANKS);
        assert_eq!(read_csv(&many).unwrap().len(), MAX_RANKS);
        let err = read_csv(&format!("{many}0F0\n")).unwrap_err();
        assert_eq!(
            err,
            CsvError::TooManyRanks {
                line: MAX_RANKS as u64 + 1
            }
        );
        let blank = "\n".repeat(MAX_RANKS + 1);
        assert!(matches!(read_csv(&blank), Err(CsvError::TooManyRanks { .. })));
        let wide = ",".repeat(MAX_CELLS);
        assert_eq!(read_csv(&wide).unwrap_err(), CsvError::TooManyCells { line: 1 });
        assert_eq!(read_csv(&wide[1..]).unwrap()[0].len(), MAX_CELLS);
    }

    #[test]
    fn cells_are_named_as_a_spreadsheet_names_them() {
        for (rank, slot, name) in [
            (0, 0, "A1"),
            (1, 2, "C2"),
            (0, 25, "Z1"),
            (9, 26, "AA10"),
            (0, 701, "ZZ1"),
            (0, 702, "AAA1"),
        ] {
            assert_eq!(cell_name(rank, slot), name);
        }
        assert_eq!(cell_name(u32::MAX, usize::MAX).len(), 14 + 10);
    }

    #[test]
    fn an_action_takes_at_most_32_bytes() {
        assert!(std::mem::size_of::<Option<Action>>() <= 32);
    }

    proptest! {
        /// Any text at all reads or is refused without a panic.
        #[test]
        fn never_panics(text in "\\PC{0,60}") {
            let _ = read_csv(&text);
            let _ = read_lowered_csv(&text);
        }

        /// Any text either reads or is refused, and what reads writes back to itself.
        #[test]
        fn any_text_reads_or_is_refused(text in "[0-9FBIWSENDRCV_UHAOLP(;),\" \r\n\u{feff}x]{0,80}") {
            if let Ok(rows) = read_csv(&text) {
                prop_assert_eq!(read_csv(&write_csv(&rows)).unwrap(), rows);
            }
        }
    }
}
