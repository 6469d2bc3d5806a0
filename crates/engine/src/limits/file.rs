//! Rows in files: `tollgate limits import` reads CSV (a header line naming
//! the columns) or JSON lines, `export` writes them. Every line is checked
//! as the loader checks a row, and a bad line is named by its number
//! before anything is written.

use std::collections::HashMap;
use std::io::{BufRead, Write};

use serde::Deserialize;

use super::{StoredRow, column_default};

/// A file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Comma-separated, a header line first; fields with a comma or a quote
    /// are quoted (`"a,b"`, `""` for a quote).
    Csv,
    /// One JSON object per line.
    Jsonl,
}

impl Format {
    /// The format a file's name suggests: `.csv` is CSV, anything else JSON
    /// lines.
    pub fn of_path(path: &str) -> Self {
        if path.to_ascii_lowercase().ends_with(".csv") {
            Self::Csv
        } else {
            Self::Jsonl
        }
    }
}

/// The columns, in the order `export` writes them.
pub const COLUMNS: [&str; 13] = [
    "name",
    "tenant",
    "plan",
    "resource",
    "scope",
    "burst",
    "rate",
    "rate_unit",
    "mode",
    "on_store_unavailable",
    "debt",
    "kind",
    "alerts",
];

/// A line as written: every column but `name`, `burst` and `rate` has the
/// table's default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRow {
    name: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    plan: String,
    #[serde(default)]
    resource: String,
    #[serde(default = "column_default::scope")]
    scope: String,
    burst: i64,
    #[serde(default)]
    rate: i64,
    #[serde(default = "column_default::rate_unit")]
    rate_unit: String,
    #[serde(default = "column_default::mode")]
    mode: String,
    #[serde(default = "column_default::on_store_unavailable")]
    on_store_unavailable: String,
    #[serde(default)]
    debt: i64,
    #[serde(default = "column_default::kind")]
    kind: String,
    #[serde(default)]
    alerts: String,
    /// Accepted (an export carries it) and ignored: the table sets it.
    #[serde(default)]
    #[allow(dead_code)]
    updated_at: String,
}

impl From<FileRow> for StoredRow {
    fn from(r: FileRow) -> Self {
        Self {
            id: 0,
            name: r.name,
            tenant: r.tenant,
            plan: r.plan,
            resource: r.resource,
            scope: r.scope,
            burst: r.burst,
            rate: r.rate,
            rate_unit: r.rate_unit,
            mode: r.mode,
            on_store_unavailable: r.on_store_unavailable,
            debt: r.debt,
            kind: r.kind,
            alerts: r.alerts,
            updated_at: String::new(),
        }
    }
}

/// The longest line read, in bytes.
pub const MAX_LINE: usize = 64 * 1024;

/// Reads every line of `input`, checks each row, and returns them with
/// their line numbers; the first bad line is an error naming it.
pub fn read_rows(input: impl BufRead, format: Format) -> Result<Vec<(usize, StoredRow)>, String> {
    let mut rows = Vec::new();
    let mut header: Option<Vec<String>> = None;
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut slots: HashMap<(String, String, String, String, String, String), usize> =
        HashMap::new();
    for (i, line) in input.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| format!("line {n}: {e}"))?;
        if line.len() > MAX_LINE {
            return Err(format!(
                "line {n} is {} bytes; at most {MAX_LINE} are allowed",
                line.len()
            ));
        }
        if line.trim().is_empty() {
            continue;
        }
        let parsed: FileRow = match format {
            Format::Jsonl => serde_json::from_str(&line).map_err(|e| format!("line {n}: {e}"))?,
            Format::Csv => {
                let fields = split_csv(&line).map_err(|e| format!("line {n}: {e}"))?;
                let Some(columns) = &header else {
                    for f in &fields {
                        if !COLUMNS.contains(&f.as_str()) {
                            return Err(format!(
                                "line {n}: unknown column {f:?}; the columns are {}",
                                COLUMNS.join(", ")
                            ));
                        }
                    }
                    header = Some(fields);
                    continue;
                };
                if fields.len() != columns.len() {
                    return Err(format!(
                        "line {n} has {} fields; the header has {}",
                        fields.len(),
                        columns.len()
                    ));
                }
                let mut object = serde_json::Map::new();
                for (column, value) in columns.iter().zip(fields) {
                    let value = if matches!(column.as_str(), "burst" | "rate" | "debt") {
                        let number: i64 = value.trim().parse().map_err(|_| {
                            format!("line {n}: {column} is {value:?}; it must be a whole number")
                        })?;
                        serde_json::Value::from(number)
                    } else {
                        serde_json::Value::String(value)
                    };
                    object.insert(column.clone(), value);
                }
                serde_json::from_value(serde_json::Value::Object(object))
                    .map_err(|e| format!("line {n}: {e}"))?
            }
        };
        let row = StoredRow::from(parsed);
        row.validate().map_err(|e| format!("line {n}: {e}"))?;
        if let Some(first) = names.insert(row.name.clone(), n) {
            return Err(format!(
                "line {n}: name {:?} is also on line {first}",
                row.name
            ));
        }
        let slot = (
            row.tenant.clone(),
            row.plan.clone(),
            row.resource.clone(),
            row.scope.clone(),
            row.mode.clone(),
            row.kind.clone(),
        );
        if let Some(first) = slots.insert(slot, n) {
            return Err(format!(
                "line {n}: line {first} already has a row for the same owner, resource, scope, mode and kind"
            ));
        }
        rows.push((n, row));
    }
    Ok(rows)
}

/// Splits one CSV line into fields.
fn split_csv(line: &str) -> Result<Vec<String>, String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    let mut at_start = true;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (false, '"') if at_start => {
                quoted = true;
                at_start = false;
            }
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => {
                quoted = false;
                if chars.peek().is_some_and(|c| *c != ',') {
                    return Err("a quoted field must end at a comma".into());
                }
            }
            (false, ',') => {
                fields.push(std::mem::take(&mut field));
                at_start = true;
            }
            (_, c) => {
                field.push(c);
                at_start = false;
            }
        }
    }
    if quoted {
        return Err("a quoted field is not closed".into());
    }
    fields.push(field);
    Ok(fields)
}

fn csv_field(value: &str) -> String {
    if value.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.to_owned()
    }
}

/// Writes the header a format needs (CSV's column line; nothing for JSON
/// lines).
pub fn write_header(out: &mut impl Write, format: Format) -> std::io::Result<()> {
    match format {
        Format::Csv => writeln!(out, "{}", COLUMNS.join(",")),
        Format::Jsonl => Ok(()),
    }
}

/// Writes one row as a line `import` reads back.
pub fn write_row(out: &mut impl Write, format: Format, row: &StoredRow) -> std::io::Result<()> {
    match format {
        Format::Csv => {
            let burst = row.burst.to_string();
            let rate = row.rate.to_string();
            let debt = row.debt.to_string();
            let fields = [
                row.name.as_str(),
                &row.tenant,
                &row.plan,
                &row.resource,
                &row.scope,
                &burst,
                &rate,
                &row.rate_unit,
                &row.mode,
                &row.on_store_unavailable,
                &debt,
                &row.kind,
                &row.alerts,
            ];
            let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
            writeln!(out, "{}", line.join(","))
        }
        Format::Jsonl => {
            let mut row = row.clone();
            row.updated_at.clear();
            serde_json::to_writer(&mut *out, &row)?;
            writeln!(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_open_a_field_and_double_to_escape() {
        assert_eq!(
            split_csv(r#"a,"say ""hi""",b"c"#).unwrap(),
            ["a", r#"say "hi""#, r#"b"c"#]
        );
    }

    #[test]
    fn lines_are_read_up_to_their_cap_exactly() {
        let header = "name,tenant,burst,rate,rate_unit\n";
        let line = |len: usize| {
            let row = "a,acme,10,100,minute,";
            format!("{header}{row}{}\n", "x".repeat(len - row.len()))
        };
        let at = read_rows(line(MAX_LINE).as_bytes(), Format::Csv).unwrap_err();
        assert!(!at.contains("bytes; at most"), "{at}");
        let over = read_rows(line(MAX_LINE + 1).as_bytes(), Format::Csv).unwrap_err();
        assert_eq!(over, "line 2 is 65537 bytes; at most 65536 are allowed");
    }

    #[test]
    fn csv_and_jsonl_round_trip_and_bad_lines_are_named() {
        let csv = "name,tenant,burst,rate,rate_unit,kind,alerts\n\
                   a,acme,10,100,minute,rate,\n\
                   \"b.quoted\",globex,5,1,second,rate,\n\
                   m,acme,0,1000,month,quota,\"50,80,100\"\n";
        let rows = read_rows(csv.as_bytes(), Format::Csv).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[2].1.alerts, "50,80,100");
        assert_eq!((rows[0].0, rows[0].1.tenant.as_str()), (2, "acme"));
        assert_eq!(rows[1].1.name, "b.quoted");
        assert_eq!(
            (rows[1].1.rate, rows[1].1.rate_unit.as_str()),
            (1, "second")
        );
        for format in [Format::Csv, Format::Jsonl] {
            let mut out = Vec::new();
            write_header(&mut out, format).unwrap();
            for (_, r) in &rows {
                write_row(&mut out, format, r).unwrap();
            }
            let back = read_rows(&out[..], format).unwrap();
            let back: Vec<_> = back.into_iter().map(|(_, r)| r).collect();
            let want: Vec<_> = rows.iter().map(|(_, r)| r.clone()).collect();
            assert_eq!(back, want, "{format:?}");
        }
        let bad = "name,tenant,burst,rate\nok,acme,1,1\nbad,acme,0,1\n";
        assert_eq!(
            read_rows(bad.as_bytes(), Format::Csv).unwrap_err(),
            "line 3: row \"bad\" (tenant \"acme\", resource \"\", scope \"key\"): burst must be at least 1"
        );
        let dup = "{\"name\":\"x\",\"burst\":1,\"rate\":1}\n{\"name\":\"x\",\"tenant\":\"t\",\"burst\":1,\"rate\":1}\n";
        assert_eq!(
            read_rows(dup.as_bytes(), Format::Jsonl).unwrap_err(),
            "line 2: name \"x\" is also on line 1"
        );
        let unknown = "name,tier\n";
        assert!(
            read_rows(unknown.as_bytes(), Format::Csv)
                .unwrap_err()
                .starts_with("line 1: unknown column \"tier\"")
        );
        let not_number = "name,burst,rate\nx,ten,1\n";
        assert_eq!(
            read_rows(not_number.as_bytes(), Format::Csv).unwrap_err(),
            "line 2: burst is \"ten\"; it must be a whole number"
        );
    }
}
