{{- define "tableserver.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tableserver.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tableserver.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The daemon's configuration: every key is a `tableserver serve` option (docs: tableserver --help). */}}
{{- define "tableserver.config" -}}
tables = [{{ printf "/tables/%s" .Values.tables.file | quote }}]
listen = {{ printf "0.0.0.0:%d" (int .Values.ports.grpc) | quote }}
tcp-listen = {{ printf "0.0.0.0:%d" (int .Values.ports.tcp) | quote }}
metrics-host = "0.0.0.0"
metrics-port = {{ .Values.ports.metrics | quote }}
shm-socket = "/run/tableserver/tableserver.sock"
transports = [{{ range $i, $t := .Values.transports }}{{ if $i }}, {{ end }}{{ $t | quote }}{{ end }}]
hugepages = {{ if eq .Values.hugepages.size "1Gi" }}"1g"{{ else if eq .Values.hugepages.size "2Mi" }}"2m"{{ else }}"off"{{ end }}
lease-seconds = {{ .Values.leaseSeconds }}
max-sessions = {{ .Values.maxSessions }}
progress = "never"
log-format = "json"
{{- if .Values.auth.existingSecret }}
auth-token-file = "/etc/tableserver/auth/token"
{{- end }}
{{- if .Values.auth.allowAnonymous }}
allow-anonymous = true
{{- end }}
{{- if .Values.tls.existingSecret }}
tls-cert = "/etc/tableserver/tls/tls.crt"
tls-key = "/etc/tableserver/tls/tls.key"
{{- end }}
{{- if .Values.tls.clientCASecret }}
tls-client-ca = "/etc/tableserver/client-ca/ca.crt"
{{- end }}
{{- if .Values.rdma.device }}
rdma-device = {{ .Values.rdma.device | quote }}
{{- end }}
{{- if ne (toString .Values.rdma.gidIndex) "" }}
rdma-gid-index = {{ .Values.rdma.gidIndex | quote }}
{{- end }}
{{- end -}}
