package trainer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"strings"
)

// marshalFinite encodes a struct of scalars (and lists of such structs)
// as encoding/json does (field order, json tags, omitempty, embedded
// structs flattened), except that a NaN or infinite float becomes null,
// which JSON can hold and json.Marshal refuses.
func marshalFinite(v any) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteByte('{')
	first := true
	var walk func(rv reflect.Value) error
	walk = func(rv reflect.Value) error {
		rt := rv.Type()
		for i := 0; i < rt.NumField(); i++ {
			f, fv := rt.Field(i), rv.Field(i)
			tag := f.Tag.Get("json")
			if f.Anonymous && f.Type.Kind() == reflect.Struct && tag == "" {
				if err := walk(fv); err != nil {
					return err
				}
				continue
			}
			name, opts, _ := strings.Cut(tag, ",")
			if !f.IsExported() || name == "-" {
				continue
			}
			if name == "" {
				name = f.Name
			}
			if strings.Contains(opts, "omitempty") && fv.IsZero() {
				continue
			}
			var b []byte
			if k := fv.Kind(); (k == reflect.Float64 || k == reflect.Float32) && (math.IsNaN(fv.Float()) || math.IsInf(fv.Float(), 0)) {
				b = []byte("null")
			} else if k == reflect.Slice && fv.Type().Elem().Kind() == reflect.Struct {
				// A list of structs of scalars (the per-teacher metrics):
				// each element as this function writes a struct.
				b = []byte{'['}
				for j := 0; j < fv.Len(); j++ {
					e, err := marshalFinite(fv.Index(j).Interface())
					if err != nil {
						return fmt.Errorf("%s[%d]: %w", name, j, err)
					}
					if j > 0 {
						b = append(b, ',')
					}
					b = append(b, e...)
				}
				b = append(b, ']')
			} else {
				var err error
				if b, err = json.Marshal(fv.Interface()); err != nil {
					return fmt.Errorf("%s: %w", name, err)
				}
			}
			if !first {
				buf.WriteByte(',')
			}
			first = false
			nb, _ := json.Marshal(name)
			buf.Write(nb)
			buf.WriteByte(':')
			buf.Write(b)
		}
		return nil
	}
	if err := walk(reflect.ValueOf(v)); err != nil {
		return nil, err
	}
	buf.WriteByte('}')
	return buf.Bytes(), nil
}
