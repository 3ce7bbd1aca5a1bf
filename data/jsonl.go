package data

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"unicode/utf8"

	"distill/data/chattmpl"
	"distill/internal/errkind"
)

// reader gives random access to the raw records of one source file. All
// methods are safe for concurrent use.
type reader interface {
	// numRecords is the number of records (non-blank lines, data rows).
	numRecords() int64
	// contentHash is the SHA-256 of the file's bytes.
	contentHash() [32]byte
	// read decodes record rec and returns it with its location ("file:line").
	// A malformed record returns a *RecordError with the location set.
	read(rec int64) (map[string]any, string, error)
	close() error
}

// lineTable maps a record number to its 1-based line number. Lines equal
// record+base unless blank lines (JSONL) or multi-line fields (CSV) came
// before; those are stored sparsely as (first record after the jump,
// cumulative extra lines), so the table costs nothing for clean files.
type lineTable struct {
	base  int64   // line of record 0 when no extra lines precede it
	at    []int64 // ascending record numbers where the extra count changes
	extra []int64 // cumulative extra lines from at[k] on
}

func (t *lineTable) add(rec, cumExtra int64) {
	if n := len(t.extra); (n == 0 && cumExtra != 0) || (n > 0 && t.extra[n-1] != cumExtra) {
		t.at = append(t.at, rec)
		t.extra = append(t.extra, cumExtra)
	}
}

func (t *lineTable) line(rec int64) int64 {
	k := sort.Search(len(t.at), func(i int) bool { return t.at[i] > rec })
	if k == 0 {
		return rec + t.base
	}
	return rec + t.base + t.extra[k-1]
}

// jsonlReader reads one JSON object per line. Blank lines are ignored.
// offsets[r] is the byte offset where record r's line starts; offsets[n] is
// the file size, so record r is the bytes [offsets[r], offsets[r+1]) with
// trailing whitespace and blank lines trimmed.
type jsonlReader struct {
	path    string
	f       *os.File
	offsets []int64
	lines   lineTable
	hash    [32]byte
}

// utf8BOM is the byte order mark some editors put at the start of UTF-8
// files; JSONL and CSV readers skip it.
var utf8BOM = []byte("\ufeff")

// indexChunk is the read size of the indexing pass: large enough that
// syscalls are negligible, small enough to keep memory bounded.
const indexChunk = 1 << 20

func openJSONL(path string) (*jsonlReader, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, errkind.Errorf(ErrSource, "%v", err)
	}
	r := &jsonlReader{path: path, f: f, lines: lineTable{base: 1}}
	if err := r.index(); err != nil {
		f.Close()
		return nil, err
	}
	return r, nil
}

// index is one streaming pass over the file: it hashes the bytes and records
// where each non-blank line starts. Memory is one read buffer plus 8 bytes
// per record.
func (r *jsonlReader) index() error {
	h := sha256.New()
	buf := make([]byte, indexChunk)
	var (
		pos       int64 // file offset of buf[0]
		lineStart int64 // offset of the current line's first byte
		inContent bool  // a non-blank byte was seen on the current line
		blanks    int64 // blank lines seen so far
	)
	for {
		n, err := r.f.Read(buf)
		if n > 0 {
			h.Write(buf[:n])
			b := buf[:n]
			i := 0
			if pos == 0 && bytes.HasPrefix(b, utf8BOM) {
				// A byte order mark (Windows editors write one) is not part
				// of the first record; it stays in the content hash.
				i = len(utf8BOM)
				lineStart = int64(i)
			}
			for i < len(b) {
				if !inContent {
					c := b[i]
					switch c {
					case ' ', '\t', '\r':
						i++
						continue
					case '\n':
						blanks++
						i++
						lineStart = pos + int64(i)
						continue
					}
					inContent = true
					r.lines.add(int64(len(r.offsets)), blanks)
					r.offsets = append(r.offsets, lineStart)
				}
				j := bytes.IndexByte(b[i:], '\n')
				if j < 0 {
					i = len(b)
					break
				}
				i += j + 1
				lineStart = pos + int64(i)
				inContent = false
			}
			pos += int64(n)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return errkind.Errorf(ErrSource, "%s: read: %v", r.path, err)
		}
	}
	if len(r.offsets) == 0 {
		return errkind.Errorf(ErrSource, "%s: no records (the file is empty or blank)", r.path)
	}
	r.offsets = append(r.offsets, pos)
	r.offsets = r.offsets[:len(r.offsets):len(r.offsets)]
	copy(r.hash[:], h.Sum(nil))
	return nil
}

func (r *jsonlReader) numRecords() int64     { return int64(len(r.offsets) - 1) }
func (r *jsonlReader) contentHash() [32]byte { return r.hash }
func (r *jsonlReader) close() error          { return r.f.Close() }

// maxRecordBytes bounds one record, so a file without newlines (a JSON array
// saved as .jsonl, say) fails clearly instead of exhausting memory.
const maxRecordBytes = 1 << 30

func (r *jsonlReader) read(rec int64) (map[string]any, string, error) {
	loc := fmt.Sprintf("%s:%d", r.path, r.lines.line(rec))
	start, end := r.offsets[rec], r.offsets[rec+1]
	if end-start > maxRecordBytes {
		return nil, loc, withLoc(badf("", "record too large", "%d bytes on one line (limit %d); is the file really JSON Lines?", end-start, maxRecordBytes), loc)
	}
	buf := make([]byte, end-start)
	if _, err := r.f.ReadAt(buf, start); err != nil && !(errors.Is(err, io.EOF)) {
		return nil, loc, errkind.Errorf(ErrSource, "%s: read: %v", loc, err)
	}
	if nl := bytes.IndexByte(buf, '\n'); nl >= 0 {
		buf = buf[:nl]
	}
	buf = bytes.TrimSpace(buf)
	obj, err := decodeJSONObject(buf)
	if err == nil && (bytes.Contains(buf, []byte(`"tool_calls"`)) || bytes.Contains(buf, []byte(`"tools"`))) {
		obj, err = decodeOrdered(buf)
	}
	return obj, loc, withLoc(err, loc)
}

// decodeJSONObject decodes one JSON object, keeping numbers exact
// (json.Number) and refusing invalid UTF-8, which encoding/json would
// otherwise silently replace with U+FFFD.
func decodeJSONObject(b []byte) (map[string]any, error) {
	v, err := decodeJSONValue(b)
	if err != nil {
		return nil, err
	}
	obj, ok := v.(map[string]any)
	if !ok {
		return nil, badf("", "malformed JSON", "want a JSON object per line, found %s", typeName(v))
	}
	return obj, nil
}

// decodeOrdered decodes a valid JSON object keeping the key order of nested
// objects (*chattmpl.Dict), which tool calls and tool schemas need: the
// template's tojson prints keys in the order Python's json.loads keeps.
func decodeOrdered(b []byte) (map[string]any, error) {
	v, err := chattmpl.ParseJSON(b)
	if err != nil {
		return nil, badf("", "malformed JSON", "%v", err)
	}
	obj, ok := asMap(v)
	if !ok {
		return nil, badf("", "malformed JSON", "want a JSON object per line")
	}
	return obj, nil
}

// decodeJSONValue decodes exactly one JSON value; see decodeJSONObject.
func decodeJSONValue(b []byte) (any, error) {
	if !utf8.Valid(b) {
		bad := 0
		for bad < len(b) {
			r, size := utf8.DecodeRune(b[bad:])
			if r == utf8.RuneError && size <= 1 {
				break
			}
			bad += size
		}
		return nil, badf("", "invalid UTF-8", "byte %d (column %d) is not valid UTF-8; re-encode the file as UTF-8", bad, bad+1)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return nil, badf("", "malformed JSON", "column %d: %v", se.Offset, err)
		}
		return nil, badf("", "malformed JSON", "%v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, badf("", "malformed JSON", "unexpected data after the JSON value at column %d (one object per line)", dec.InputOffset()+1)
	}
	return v, nil
}
