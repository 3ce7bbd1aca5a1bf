package data

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/csv"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"unicode/utf8"

	"distill/internal/errkind"
)

// csvReader reads a CSV file with a header row naming the columns. Cells are
// strings; the messages, input_ids and loss_mask cells hold JSON (a list), so
// any record shape can be stored in CSV. Empty cells count as absent.
// offsets[r] is where data row r starts; quoted fields may span lines, which
// the line table accounts for.
type csvReader struct {
	path    string
	f       *os.File
	header  []string
	jsonCol map[string]bool // columns whose cells are decoded as JSON
	offsets []int64
	lines   lineTable
	hash    [32]byte
}

// hashingReader feeds everything csv.Reader reads into the content hash, so
// the indexing pass reads the file once.
type hashingReader struct {
	r io.Reader
	h hash.Hash
}

func (h *hashingReader) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	h.h.Write(p[:n])
	return n, err
}

func openCSV(path string, cols ColumnMap) (*csvReader, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, errkind.Errorf(ErrSource, "%v", err)
	}
	r := &csvReader{path: path, f: f, jsonCol: map[string]bool{cols.Messages: true, cols.InputIDs: true, cols.LossMask: true}}
	if err := r.index(); err != nil {
		f.Close()
		return nil, err
	}
	return r, nil
}

func (r *csvReader) index() error {
	hr := &hashingReader{r: r.f, h: sha256.New()}
	br := bufio.NewReaderSize(hr, indexChunk)
	// A byte order mark (Excel writes one) is not part of the first column
	// name, and would make a quoted one malformed; it stays in the hash.
	var skip int64
	if b, _ := br.Peek(len(utf8BOM)); bytes.Equal(b, utf8BOM) {
		br.Discard(len(utf8BOM))
		skip = int64(len(utf8BOM))
	}
	cr := csv.NewReader(br)
	cr.ReuseRecord = true
	cr.FieldsPerRecord = -1 // a short row is one bad record, not a bad file
	head, err := cr.Read()
	if err == io.EOF {
		return errkind.Errorf(ErrSource, "%s: empty CSV file (want a header row naming the columns)", r.path)
	}
	if err != nil {
		return errkind.Errorf(ErrSource, "%s: header: %v", r.path, err)
	}
	r.header = append([]string(nil), head...)
	seen := map[string]bool{}
	for _, h := range r.header {
		if seen[h] {
			return errkind.Errorf(ErrSource, "%s:1: duplicate column %q in the header", r.path, h)
		}
		seen[h] = true
	}
	off := skip + cr.InputOffset()
	line, _ := cr.FieldPos(0)
	r.lines.base = int64(line) + 1
	for {
		rec := int64(len(r.offsets))
		_, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			// A broken quote makes every later row boundary unknowable, so
			// this cannot be skipped record by record.
			var pe *csv.ParseError
			if errors.As(err, &pe) {
				return errkind.Errorf(ErrSource, "%s:%d: malformed CSV: %v (row boundaries after it are unknown; fix the file)", r.path, pe.StartLine, pe.Err)
			}
			return errkind.Errorf(ErrSource, "%s: %v", r.path, err)
		}
		l, _ := cr.FieldPos(0)
		r.lines.add(rec, int64(l)-(rec+r.lines.base))
		r.offsets = append(r.offsets, off)
		off = skip + cr.InputOffset()
	}
	if len(r.offsets) == 0 {
		return errkind.Errorf(ErrSource, "%s: no data rows after the header", r.path)
	}
	r.offsets = append(r.offsets, off)
	copy(r.hash[:], hr.h.Sum(nil))
	return nil
}

func (r *csvReader) numRecords() int64     { return int64(len(r.offsets) - 1) }
func (r *csvReader) contentHash() [32]byte { return r.hash }
func (r *csvReader) close() error          { return r.f.Close() }

func (r *csvReader) read(rec int64) (map[string]any, string, error) {
	loc := fmt.Sprintf("%s:%d", r.path, r.lines.line(rec))
	start, end := r.offsets[rec], r.offsets[rec+1]
	if end-start > maxRecordBytes {
		return nil, loc, withLoc(badf("", "record too large", "%d bytes in one row (limit %d)", end-start, maxRecordBytes), loc)
	}
	buf := make([]byte, end-start)
	if _, err := r.f.ReadAt(buf, start); err != nil && !errors.Is(err, io.EOF) {
		return nil, loc, errkind.Errorf(ErrSource, "%s: read: %v", loc, err)
	}
	if !utf8.Valid(buf) {
		return nil, loc, withLoc(badf("", "invalid UTF-8", "the row is not valid UTF-8; re-encode the file as UTF-8"), loc)
	}
	cr := csv.NewReader(bytes.NewReader(buf))
	cr.FieldsPerRecord = -1
	row, err := cr.Read()
	if err != nil {
		return nil, loc, withLoc(badf("", "malformed CSV", "%v", err), loc)
	}
	if len(row) != len(r.header) {
		return nil, loc, withLoc(badf("", "malformed CSV", "%d fields, the header has %d", len(row), len(r.header)), loc)
	}
	obj := make(map[string]any, len(row))
	for i, cell := range row {
		if cell == "" {
			continue
		}
		name := r.header[i]
		if r.jsonCol[name] {
			v, err := decodeJSONValue([]byte(cell))
			if err != nil {
				return nil, loc, withLoc(prefixField(err, name), loc)
			}
			obj[name] = v
			continue
		}
		obj[name] = cell
	}
	return obj, loc, nil
}
